"""RoPE on the fused q/k/v projection output in one pass each way (Triton), as a custom op.

The trunk computes q, k, v with one GEMM (T, (heads + 2 kv_heads) * head_dim), splits it and
rotates q and k. Compiled by inductor, the rotation's forward and backward ran well below
the memory bandwidth (the split, `rotate_half`'s concatenation and its backward became
strided gathers), a large cost for a few MB per layer. Here one program takes a
block of tokens and rotates all their q and k heads as one tile:

  forward   q, k rotated and v copied out of the projection output, each contiguous
            (T, heads, head_dim), as flash attention reads them;
  backward  d(q, k) rotated back and d v, written straight into the projection's gradient.

The arithmetic is `layers.apply_rope` (x * cos + rotate_half(x) * sin with the cos/sin the
caller computed, in float32, rounded once). Where Triton cannot run (CPU builds, float32)
the same formula runs as torch ops. Registered with torch.library so a compiled trunk calls
it as one opaque kernel (no graph break) and autograd pairs it with its backward op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.models.layers import apply_rope
from pipeline.models.triton_support import half_kernel_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch formula serves
    triton = None

# elements of a (tokens, heads, half head) tile per program, 4 warps (faster than a tile
# per head: docs/performance.md)
TILE = 1024
WARPS = 4


def _launch(
    qkv: Tensor, cos: Tensor, sin: Tensor, q: Tensor, k: Tensor, v: Tensor, *, backward: bool
) -> None:
    t, hd = cos.shape
    heads, kv_heads = q.shape[1], k.shape[1]
    nh = triton.next_power_of_2(heads + kv_heads)
    block_t = max(1, TILE // (nh * hd // 2))
    _rope_kernel[(triton.cdiv(t, block_t),)](
        qkv, cos.contiguous(), sin.contiguous(), q, k, v, t, HEADS=heads, KV_HEADS=kv_heads,
        HD=hd, NH=nh, BACKWARD=backward, BLOCK_T=block_t, num_warps=WARPS,
    )  # fmt: skip


def kernel_supported(x: Tensor, head_dim: int) -> bool:
    """Triton present, a power-of-two head_dim, and CUDA half precision (or the Triton
    interpreter, for tests)."""
    return head_dim >= 2 and not head_dim & (head_dim - 1) and half_kernel_runs(x)


def _torch_forward(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    t, hd = cos.shape
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = apply_rope(q.reshape(1, t, heads, hd), cos[None], sin[None])[0]
    k = apply_rope(k.reshape(1, t, kv_heads, hd), cos[None], sin[None])[0]
    return q.contiguous(), k.contiguous(), v.reshape(t, kv_heads, hd).clone()


def _torch_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The adjoint of the rotation: x1 * c1 - x2 * s1, x2 * c2 + x1 * s2 (halves 1, 2)."""
    half = cos.shape[-1] // 2

    def unrotate(d: Tensor) -> Tensor:
        c, s = cos[:, None].float(), sin[:, None].float()
        d = d.float()
        d1, d2 = d[..., :half], d[..., half:]
        x1 = d1 * c[..., :half] + d2 * s[..., half:]
        x2 = d2 * c[..., half:] - d1 * s[..., :half]
        return torch.cat([x1, x2], dim=-1).to(dq.dtype)

    t = cos.shape[0]
    return torch.cat(
        [unrotate(dq).reshape(t, -1), unrotate(dk).reshape(t, -1), dv.reshape(t, -1)], -1
    )


@torch.library.custom_op("pipeline::rope_qkv", mutates_args=())
def _rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    t, hd = cos.shape
    if not kernel_supported(qkv, hd):
        return _torch_forward(qkv, cos, sin, heads, kv_heads)
    q = qkv.new_empty(t, heads, hd)
    k = qkv.new_empty(t, kv_heads, hd)
    v = qkv.new_empty(t, kv_heads, hd)
    if t:
        _launch(qkv.contiguous(), cos, sin, q, k, v, backward=False)
    return q, k, v


@_rope_qkv.register_fake
def _(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, ...]:
    t, hd = cos.shape
    return (
        qkv.new_empty(t, heads, hd),
        qkv.new_empty(t, kv_heads, hd),
        qkv.new_empty(t, kv_heads, hd),
    )


@torch.library.custom_op("pipeline::rope_qkv_backward", mutates_args=())
def _rope_qkv_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    t, heads, hd = dq.shape
    if not kernel_supported(dq, hd):
        return _torch_backward(dq, dk, dv, cos, sin)
    kv_heads = dk.shape[1]
    dqkv = dq.new_empty(t, (heads + 2 * kv_heads) * hd)
    if t:
        _launch(dqkv, cos, sin, dq.contiguous(), dk.contiguous(), dv.contiguous(), backward=True)
    return dqkv


@_rope_qkv_backward.register_fake
def _(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return dq.new_empty(dq.shape[0], (dq.shape[1] + 2 * dk.shape[1]) * dq.shape[2])


def _setup(ctx, inputs, output) -> None:
    _, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return _rope_qkv_backward(dq, dk, dv, cos, sin), None, None, None, None


_rope_qkv.register_autograd(_backward, setup_context=_setup)


def rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (T, (heads + 2 kv_heads) * head_dim), cos/sin (T, head_dim) -> q (T, heads,
    head_dim) and k (T, kv_heads, head_dim) rotated, v (T, kv_heads, head_dim), contiguous.
    Differentiable in qkv only (cos/sin come from positions)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope_qkv does not differentiate cos/sin")
    return _rope_qkv(qkv, cos, sin, heads, kv_heads)


if triton is not None:

    @triton.jit
    def _rope_kernel(
        qkv_ptr,  # forward: read; backward: the gradient written
        cos_ptr,
        sin_ptr,
        q_ptr,  # forward: written; backward: d q read
        k_ptr,
        v_ptr,
        T,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HD: tl.constexpr,
        NH: tl.constexpr,  # HEADS + KV_HEADS rounded up to a power of two
        BACKWARD: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """One (tokens, q and k heads, half head) tile per half: each token's q|k columns
        are contiguous in the projection, so the loads and stores vectorize."""
        HALF: tl.constexpr = HD // 2
        WIDTH: tl.constexpr = (HEADS + 2 * KV_HEADS) * HD
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
        t_in = (tok < T)[:, None, None]
        t3 = tok.to(tl.int64)[:, None, None]
        h3 = tl.arange(0, NH)[None, :, None]
        j3 = tl.arange(0, HALF)[None, None, :]  # (1, 1, HALF)
        cs = t3 * HD + j3
        c1 = tl.load(cos_ptr + cs, mask=t_in, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + HALF, mask=t_in, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=t_in, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + HALF, mask=t_in, other=0.0).to(tl.float32)
        is_q = t_in & (h3 < HEADS)
        is_k = t_in & (h3 >= HEADS) & (h3 < HEADS + KV_HEADS)
        fused = qkv_ptr + t3 * WIDTH + h3 * HD + j3  # first halves of the q|k heads
        q = q_ptr + t3 * (HEADS * HD) + h3 * HD + j3
        k = k_ptr + t3 * (KV_HEADS * HD) + (h3 - HEADS) * HD + j3
        if BACKWARD:
            d1 = tl.load(q, mask=is_q, other=0.0) + tl.load(k, mask=is_k, other=0.0)
            d2 = tl.load(q + HALF, mask=is_q, other=0.0) + tl.load(k + HALF, mask=is_k, other=0.0)
            d1, d2 = d1.to(tl.float32), d2.to(tl.float32)
            x1 = (d1 * c1 + d2 * s2).to(qkv_ptr.dtype.element_ty)
            x2 = (d2 * c2 - d1 * s1).to(qkv_ptr.dtype.element_ty)
            tl.store(fused, x1, mask=is_q | is_k)
            tl.store(fused + HALF, x2, mask=is_q | is_k)
        else:
            x1 = tl.load(fused, mask=is_q | is_k, other=0.0).to(tl.float32)
            x2 = tl.load(fused + HALF, mask=is_q | is_k, other=0.0).to(tl.float32)
            o1 = (x1 * c1 - x2 * s1).to(q_ptr.dtype.element_ty)
            o2 = (x2 * c2 + x1 * s2).to(q_ptr.dtype.element_ty)
            tl.store(q, o1, mask=is_q)
            tl.store(q + HALF, o2, mask=is_q)
            tl.store(k, o1, mask=is_k)
            tl.store(k + HALF, o2, mask=is_k)
        t2 = tok.to(tl.int64)[:, None]
        jj = tl.arange(0, KV_HEADS * HD)[None, :]  # the v heads: a plain copy
        v_in = (tok < T)[:, None]
        packed = qkv_ptr + t2 * WIDTH + (HEADS + KV_HEADS) * HD + jj
        alone = v_ptr + t2 * (KV_HEADS * HD) + jj
        if BACKWARD:
            tl.store(packed, tl.load(alone, mask=v_in, other=0.0), mask=v_in)
        else:
            tl.store(alone, tl.load(packed, mask=v_in, other=0.0), mask=v_in)
