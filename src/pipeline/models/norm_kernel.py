"""Residual add + RMSNorm in one pass each way (Triton), as a custom op.

A pre-norm block adds each sublayer's output to the residual stream and normalises the sum
for the next sublayer. Compiled by inductor, the forward of that pair is one kernel at
bandwidth, but its backward is three: by default (inductor's "mix-order reduction") one
Triton kernel for the input gradient with the residual gradient added and 512 partial rows
of the weight's gradient, then an ATen sum of those rows and a cast, for every norm of a
step; with that reduction off (`trainer.compile_options`, as the single-GPU profile sets
it) the weight's gradient is two Triton reductions of their own. Here:

  forward   s = x + delta (the residual stream, rounded to the compute dtype) and
            y = weight * round(s * rstd), rstd = 1 / sqrt(mean(s^2) + eps) in float32;
  backward  one persistent program per group of rows writes d s = d s_in + d(norm)/d s
            (the gradient of x and of delta alike), ROWS rows a step, and keeps its rows'
            share of d weight = sum(dy * round(s * rstd)) in registers; a second kernel
            sums the programs' shares and rounds the total to the weight's dtype (in place
            of ATen's sum of 1024 partial rows and its cast: one launch fewer a norm).

The rounding follows `layers.RMSNorm` (normalise in float32, round, then multiply by the
weight in the compute dtype). Where Triton cannot run (CPU builds, float32) the same formula
runs as torch ops, with its backward written out (the op's implementation runs below
autograd). Registered with torch.library so a compiled trunk calls it as one opaque kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.models.triton_support import half_kernel_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch formula serves
    triton = None

# backward: programs (each keeps a partial weight gradient), rows per step of each, warps;
# then the partial weight gradients' sum: columns per program, partial rows per step (the
# fastest tiling measured: docs/performance.md)
ROW_PROGRAMS = 264
ROWS = 8
BACKWARD_WARPS = 4
FINISH_COLS = 64
FINISH_ROWS = 128


def kernel_supported(x: Tensor) -> bool:
    """Triton present and CUDA half precision (or the Triton interpreter, for tests)."""
    return half_kernel_runs(x)


def _torch_forward(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    s = x if delta is None else x + delta
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1) + eps)  # (rows,)
    y = weight * (sf * rstd[:, None]).to(x.dtype)
    return s, y, rstd


def _torch_backward(
    dy: Tensor, ds_in: Tensor | None, s: Tensor, rstd: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor]:
    """(d s with the residual gradient added, d weight): the adjoint of `_torch_forward`."""
    xhat = s.float() * rstd[:, None]  # (rows, hidden)
    dw = (dy * xhat.to(s.dtype)).float().sum(0).to(weight.dtype)
    dxhat = (dy * weight).float()
    mean = (dxhat * xhat).mean(-1, keepdim=True)
    ds = ((dxhat - xhat * mean) * rstd[:, None]).to(s.dtype)
    return (ds if ds_in is None else ds + ds_in), dw


@torch.library.custom_op("pipeline::add_rms_norm", mutates_args=())
def _add_rms_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(s = x + delta, or an empty tensor without delta; y; rstd (rows,) float32)."""
    if not kernel_supported(x):
        s, y, rstd = _torch_forward(x, delta, weight, eps)
        return (s if delta is not None else x.new_empty(0)), y, rstd
    rows, hidden = x.shape
    s = torch.empty_like(x) if delta is not None else x.new_empty(0)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        x = x.contiguous()
        d = x if delta is None else delta.contiguous()
        _norm_forward[(rows,)](
            x, d, weight, s, y, rstd, hidden, eps, HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(hidden), num_warps=4,
        )  # fmt: skip
    return s, y, rstd


@_add_rms_norm.register_fake
def _(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, ...]:
    s = torch.empty_like(x) if delta is not None else x.new_empty(0)
    return s, torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("pipeline::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(
    dy: Tensor, ds_in: Tensor | None, s: Tensor, rstd: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor]:
    if not kernel_supported(dy):
        return _torch_backward(dy, ds_in, s, rstd, weight)
    rows, hidden = s.shape
    ds = torch.empty_like(s)
    dw = torch.empty_like(weight)
    if not rows:
        return ds, dw.zero_()
    programs = max(1, min(triton.cdiv(rows, ROWS), ROW_PROGRAMS))
    partial = torch.empty(programs, hidden, dtype=torch.float32, device=s.device)
    g = dy.contiguous()
    r = g if ds_in is None else ds_in.contiguous()
    block = triton.next_power_of_2(hidden)
    _norm_backward[(programs,)](
        g, r, s.contiguous(), rstd, weight, ds, partial, rows, hidden,
        HAS_RESIDUAL=ds_in is not None, BLOCK=block, ROWS=ROWS, num_warps=BACKWARD_WARPS,
    )  # fmt: skip
    _sum_partials[(triton.cdiv(hidden, FINISH_COLS),)](
        partial, dw, programs, hidden, COLS=FINISH_COLS, PARTS=FINISH_ROWS
    )
    return ds, dw


@_add_rms_norm_backward.register_fake
def _(dy: Tensor, ds_in: Tensor | None, s: Tensor, rstd: Tensor, weight: Tensor):
    return torch.empty_like(s), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    x, delta, weight, _ = inputs
    s, _, rstd = output
    ctx.has_delta = delta is not None
    ctx.save_for_backward(s if delta is not None else x, rstd, weight)


def _backward(ctx, ds_out, dy, _drstd):
    s, rstd, weight = ctx.saved_tensors
    # autograd hands zeros for an unused output (without delta, s is an empty placeholder)
    residual = ds_out if ctx.has_delta else None
    ds, dw = _add_rms_norm_backward(dy, residual, s, rstd, weight)
    return ds, (ds if ctx.has_delta else None), dw, None


_add_rms_norm.register_autograd(_backward, setup_context=_setup)


def add_rms_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(s, y) for x, delta (..., hidden) and weight (hidden,): s = x + delta (x itself
    without delta), y = RMSNorm(s) as `layers.RMSNorm` computes it. Differentiable in x,
    delta and weight."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    d = None if delta is None else delta.reshape(-1, shape[-1])
    s, y, _ = _add_rms_norm(flat, d, weight, eps)
    s = x if delta is None else s.view(shape)
    return s, y.view(shape)


if triton is not None:

    @triton.jit
    def _norm_forward(
        x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, rstd_ptr, hidden, eps,
        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        x = tl.load(x_ptr + row * hidden + cols, mask=inside, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * hidden + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + row * hidden + cols, x, mask=inside)
        sf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sf * sf, 0) / hidden + eps)
        xhat = (sf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * hidden + cols, (xhat * w).to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _norm_backward(
        dy_ptr, res_ptr, s_ptr, rstd_ptr, w_ptr, ds_ptr, partial_ptr, rows, hidden,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), tl.float32)
        low = s_ptr.dtype.element_ty
        for i in range(0, tl.cdiv(rows, programs * ROWS)):
            r = (pid + i * programs) * ROWS + tl.arange(0, ROWS)  # ROWS rows, then a stride
            live = (r[:, None] < rows) & inside[None, :]
            at = r[:, None].to(tl.int64) * hidden + cols[None, :]
            sf = tl.load(s_ptr + at, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + at, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
            xhat = sf * rstd[:, None]
            # d weight: dy * xhat rounded as the forward rounded it, each product rounded
            xhat_low = xhat.to(low).to(tl.float32)
            dw += tl.sum((dy * xhat_low).to(low).to(tl.float32), 0)
            dxhat = (dy * w[None, :]).to(low).to(tl.float32)
            mean = tl.sum(dxhat * xhat, 1) / hidden
            ds = ((dxhat - xhat * mean[:, None]) * rstd[:, None]).to(low)
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + at, mask=live, other=0.0)
                ds = (ds.to(tl.float32) + res.to(tl.float32)).to(low)
            tl.store(ds_ptr + at, ds, mask=live)
        tl.store(partial_ptr + pid.to(tl.int64) * hidden + cols, dw, mask=inside)

    @triton.jit
    def _sum_partials(partial_ptr, out_ptr, parts, hidden, COLS: tl.constexpr, PARTS: tl.constexpr):
        """out[c] = sum over the partial rows of partial[:, c], rounded once to out's dtype."""
        cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
        acc = tl.zeros((COLS,), tl.float32)
        for start in range(0, parts, PARTS):
            p = start + tl.arange(0, PARTS)
            live = (p[:, None] < parts) & (cols[None, :] < hidden)
            tile = tl.load(partial_ptr + p[:, None] * hidden + cols[None, :], mask=live, other=0.0)
            acc += tl.sum(tile, 0)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < hidden)
