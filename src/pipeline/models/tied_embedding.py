"""The input embedding's gradient added row by row into a tied output layer's gradient.

With tied embeddings (Qwen2.5-0.5B: a 152k x 896 table) the table gets two gradients: the
output layer's d(W) (dense, from its GEMM) and the embedding's, which is non-zero only in
the rows of the micro-batch's tokens. Left to autograd, the embedding's backward writes a
dense table (zeros, a scatter of the token rows, a cast: inductor's three kernels) and
autograd adds the two tables: all of it memory traffic over full tables (272 MB) for a
few thousand token rows.

Here the output layer's function (models/logprobs.py) puts its d(W) in a `TiedGrad` slot
created for that forward instead of handing it to autograd, and the embedding's backward,
which autograd runs after it (the embedding's output reaches the output layer only through
the trunk), adds its token rows into that tensor in place and returns it as the table's
gradient: autograd sees one gradient per forward, whatever else it sums (several forwards
before one backward each pair their own). Without a d(W) in the slot (the output layer
not differentiated, or not ours) it returns the dense gradient as `nn.Embedding` would.

Numerics equal the dense path: each row's token gradients are summed in float32, rounded
once to the table's dtype, then added to d(W)'s row (rounded again), as the dense
gradient's cast and autograd's add do.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the dense torch version serves
    triton = None


class TiedGrad:
    """One forward's meeting point of a tied table's two gradients: the output layer's
    backward puts its d(W) in `grad`; the embedding's backward adds into it."""

    def __init__(self) -> None:
        self.grad: Tensor | None = None


def tied_embedding(input_ids: Tensor, weight: Tensor, slot: TiedGrad) -> Tensor:
    """`F.embedding(input_ids, weight)` whose weight gradient goes into `slot.grad` when the
    output layer's backward left one there (see the module docstring)."""
    return _TiedEmbedding.apply(input_ids, weight, slot)


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_ids: Tensor, weight: Tensor, slot: TiedGrad) -> Tensor:
        ctx.save_for_backward(input_ids)
        ctx.slot = slot
        ctx.table_shape, ctx.table_dtype = weight.shape, weight.dtype
        return F.embedding(input_ids, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        (input_ids,) = ctx.saved_tensors
        ids = input_ids.reshape(-1)
        rows = grad_out.reshape(ids.numel(), -1)
        target, ctx.slot.grad = ctx.slot.grad, None
        if target is None:  # as nn.Embedding: a dense gradient
            return None, _dense(ctx.table_shape, ctx.table_dtype, ids, rows), None
        return None, add_rows_(target.contiguous(), ids, rows), None


def _dense(shape: torch.Size, dtype: torch.dtype, ids: Tensor, rows: Tensor) -> Tensor:
    """The dense table gradient of an embedding lookup: token rows summed in float32, cast."""
    table = torch.zeros(shape, dtype=torch.float32, device=rows.device)
    return table.index_add_(0, ids, rows.float()).to(dtype)


def add_rows_(table: Tensor, ids: Tensor, rows: Tensor) -> Tensor:
    """table[i] += (sum of rows[j] with ids[j] == i, in float32, rounded to table's dtype),
    in place; the result a dense gradient's cast and add would give. One Triton program
    per token after a sort of the ids on CUDA; the dense computation elsewhere."""
    if ids.numel() == 0:
        return table
    if not _kernel_supported(table):
        return table.add_(_dense(table.shape, table.dtype, ids, rows))
    # int32 keys (a vocabulary under 2^31): a radix sort of half the passes of int64's
    sorted_ids, order = torch.sort(ids.to(torch.int32), stable=True)
    ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    n, width = rows.shape
    _add_rows_kernel[(n,)](
        table,
        rows.contiguous(),
        sorted_ids,
        order,
        ends,
        width,
        BF16=table.dtype == torch.bfloat16,
        BLOCK=triton.next_power_of_2(width),
        num_warps=4,
    )
    return table


def _kernel_supported(table: Tensor) -> bool:
    """Triton present, a contiguous bfloat16 or float32 table on CUDA (or the Triton
    interpreter, for tests)."""
    if triton is None or not table.is_contiguous():
        return False
    if table.dtype not in (torch.bfloat16, torch.float32):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return table.is_cuda


if triton is not None:
    from pipeline.models.bf16 import to_bf16

    @triton.jit
    def _add_rows_kernel(
        table_ptr,
        rows_ptr,
        ids_ptr,
        order_ptr,
        ends_ptr,
        width,
        BF16: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program i (a position in id order) adds the rows of its id's run if it starts it
        (`ends`: where each position's run ends)."""
        i = tl.program_id(0)
        row = tl.load(ids_ptr + i)
        previous = tl.load(ids_ptr + i - 1, mask=i > 0, other=-1)
        if row != previous:
            cols = tl.arange(0, BLOCK)
            inside = cols < width
            acc = tl.zeros((BLOCK,), tl.float32)
            for j in range(i, tl.load(ends_ptr + i)):
                src = tl.load(order_ptr + j).to(tl.int64) * width
                acc += tl.load(rows_ptr + src + cols, mask=inside, other=0.0).to(tl.float32)
            out = table_ptr + row.to(tl.int64) * width + cols
            current = tl.load(out, mask=inside).to(tl.float32)
            if BF16:  # rounded as the dense gradient's cast, then as its add
                tl.store(out, to_bf16(current + to_bf16(acc).to(tl.float32)), mask=inside)
            else:
                tl.store(out, current + acc, mask=inside)
