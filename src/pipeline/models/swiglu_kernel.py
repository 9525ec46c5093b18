"""SwiGLU on one gate|up projection output in one pass each way (Triton), as a custom op.

Training ran the gated MLP's gate and up projections as two GEMMs, so that inductor's
pointwise SwiGLU read and wrote contiguous tensors: with one concatenated weight its compiled
backward wrote d(gate | up) through the split's strided view well below the bandwidth of a
contiguous write. Here one GEMM produces gu = x @ [W_gate; W_up]^T, (T, 2 I), and one
program takes BLOCK consecutive elements of h (row-major over T x I; faster than 2-D tiles
in a measurement: docs/performance.md):

  forward   h = silu(g) * u with g = gu[:, :I], u = gu[:, I:], (T, I);
  backward  d gu = [dh * u * s * (1 + g (1 - s)), dh * silu(g)], s = sigmoid(g), written
            straight into the one (T, 2 I) gradient the GEMM's backward reads.

Arithmetic in float32 from the compute dtype, rounded once (as inductor's fused pointwise
kernel does). Where Triton cannot run (CPU builds, float32) the same formula runs as torch
ops. Registered with torch.library so a compiled trunk calls it as one opaque kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.models.triton_support import half_kernel_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch formula serves
    triton = None

BLOCK = 2048  # elements of h per program (8 warps)


def kernel_supported(x: Tensor) -> bool:
    """Triton present and CUDA half precision (or the Triton interpreter, for tests)."""
    return half_kernel_runs(x)


def _torch_forward(gu: Tensor) -> Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu.dtype)


def _torch_backward(dh: Tensor, gu: Tensor) -> Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    d, s = dh.float(), torch.sigmoid(g)
    dg = d * u * s * (1 + g * (1 - s))
    return torch.cat([dg, d * g * s], dim=-1).to(gu.dtype)


def _launch(gu: Tensor, h: Tensor, dgu: Tensor, backward: bool) -> None:
    cols = gu.shape[1] // 2
    n = gu.shape[0] * cols
    grid = (triton.cdiv(n, BLOCK),)
    _swiglu_kernel[grid](gu, h, dgu, n, cols, BACKWARD=backward, BLOCK=BLOCK, num_warps=8)


@torch.library.custom_op("pipeline::swiglu_packed", mutates_args=())
def _swiglu_packed(gu: Tensor) -> Tensor:
    if not kernel_supported(gu):
        return _torch_forward(gu)
    gu = gu.contiguous()
    h = gu.new_empty(gu.shape[0], gu.shape[1] // 2)
    if gu.numel():
        _launch(gu, h, gu, backward=False)
    return h


@_swiglu_packed.register_fake
def _(gu: Tensor) -> Tensor:
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.custom_op("pipeline::swiglu_packed_backward", mutates_args=())
def _swiglu_packed_backward(dh: Tensor, gu: Tensor) -> Tensor:
    if not kernel_supported(gu):
        return _torch_backward(dh, gu)
    gu, dh = gu.contiguous(), dh.contiguous()
    dgu = torch.empty_like(gu)
    if gu.numel():
        _launch(gu, dh, dgu, backward=True)
    return dgu


@_swiglu_packed_backward.register_fake
def _(dh: Tensor, gu: Tensor) -> Tensor:
    return torch.empty_like(gu)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dh):
    (gu,) = ctx.saved_tensors
    return _swiglu_packed_backward(dh, gu)


_swiglu_packed.register_autograd(_backward, setup_context=_setup)


def swiglu_packed(gu: Tensor) -> Tensor:
    """gu (..., 2 I): the gate projection's output then the up projection's -> silu(gate) *
    up, (..., I). Differentiable."""
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu_packed wants an even last dimension, got {gu.shape[-1]}")
    lead = gu.shape[:-1]
    return _swiglu_packed(gu.reshape(-1, gu.shape[-1])).view(*lead, gu.shape[-1] // 2)


if triton is not None:

    @triton.jit
    def _swiglu_kernel(
        gu_ptr,  # (T, 2 COLS): read both ways
        h_ptr,  # forward: h written; backward: dh read; (T, COLS)
        dgu_ptr,  # backward: d gu written (forward: unused)
        N,  # T * COLS
        COLS,
        BACKWARD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # index into h
        inside = n < N
        packed = n + (n // COLS) * COLS  # row t's gate column: t * 2 COLS + j; up is COLS on
        g = tl.load(gu_ptr + packed, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + packed + COLS, mask=inside, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        if BACKWARD:
            d = tl.load(h_ptr + n, mask=inside, other=0.0).to(tl.float32)
            dg = d * u * s * (1.0 + g * (1.0 - s))
            du = d * g * s
            tl.store(dgu_ptr + packed, dg.to(dgu_ptr.dtype.element_ty), mask=inside)
            tl.store(dgu_ptr + packed + COLS, du.to(dgu_ptr.dtype.element_ty), mask=inside)
        else:
            tl.store(h_ptr + n, (g * s * u).to(h_ptr.dtype.element_ty), mask=inside)
