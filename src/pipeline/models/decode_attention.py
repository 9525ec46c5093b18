"""Decode attention that reads the slot KV cache in place (Triton; CUDA, or its interpreter).

The SDPA path of a decode step gathers every row's cached keys and values into a fresh
(b, kv_len, kv_heads, head_dim) tensor per layer and masks by position, kv_len being the CUDA
graph's bucket; at batch 64-256 that copy costs as much as the attention itself. Here each
program reads one row's own slot, only up to that row's length, for all query heads of one KV
head at once (grouped-query attention), over one chunk of the sequence; the chunks of a row
run in parallel (split-K) and a second kernel merges their softmax partials. A row of length
0 (padding, or a finished row kept in the batch) gets zeros.

Numerics: scores, softmax and accumulation in float32 (probabilities rounded to the cache's
dtype for the value product, as flash attention does); scale 1/sqrt(head_dim) as in SDPA.
"""

from __future__ import annotations

import math

import torch

from pipeline.models.triton_support import half_kernel_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the SDPA path serves
    triton = None

CHUNK = 128  # sequence positions per program
BLOCK_N = 64  # positions per inner step


def decode_kernel_supported(k_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether `decode_attention` runs for this cache: Triton present, CUDA half precision (or
    the Triton interpreter, for tests), head_dim a power of two >= 16."""
    head_dim, kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    if head_dim < 16 or head_dim & (head_dim - 1) or num_heads % kv_heads:
        return False
    return half_kernel_runs(k_cache)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over positions [0, lengths[i]) of slot slots[i].

    q (b, heads, d); k_cache/v_cache (num_slots, columns, kv_heads, d) of one layer; slots and
    lengths (b,) int64; max_len >= every length (static, e.g. the CUDA graph's kv bucket).
    new: this step's keys and values (b, kv_heads, d) each, in the cache's dtype: written to
    position lengths[i] - 1 of each row by the kernel (rows of length 0 write nothing) and
    attended to from registers, instead of a separate cache write before the call.
    Returns (b, heads, d) in q's dtype.
    """
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    splits = max(1, math.ceil(max_len / CHUNK))
    q = q.contiguous()
    # unread without WRITE; the kernel reads head_dim with unit stride
    k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in new or (q, q))
    m = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty(b, heads, splits, d, dtype=torch.float32, device=q.device)
    _partial[(b, kv_heads, splits)](
        q, k_cache, v_cache, slots, lengths, m, lse, acc, k_new, v_new,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        1.0 / math.sqrt(d),
        HEADS=heads, SPLITS=splits, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)),
        D=d, CHUNK=CHUNK, BLOCK_N=BLOCK_N, WRITE=new is not None,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge[(b, heads)](
        m, lse, acc, out, HEADS=heads, SPLITS=splits, S_PAD=triton.next_power_of_2(splits), D=d
    )
    return out


if triton is not None:

    @triton.jit
    def _partial(
        q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, kn_ptr, vn_ptr,
        stride_qb, stride_qh, stride_ks, stride_kn, stride_kh, stride_vs, stride_vn, stride_vh,
        stride_knb, stride_knh, stride_vnb, stride_vnh,
        scale,
        HEADS: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
        D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, WRITE: tl.constexpr,
    ):  # fmt: skip
        """Softmax partials (max, sum, weighted values) of one row, KV head and chunk; with
        WRITE, the chunk holding the row's last position stores this step's key and value
        there and takes them from registers (its own loads of that position may be stale)."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slots_ptr + row)
        length = tl.load(lens_ptr + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        live = g < GROUP
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=live[:, None],
            other=0.0,
        )  # (G_PAD, D)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        k_base = k_ptr + slot * stride_ks + kvh * stride_kh
        v_base = v_ptr + slot * stride_vs + kvh * stride_vh
        last = length - 1
        if WRITE:
            k_new = tl.load(kn_ptr + row * stride_knb + kvh * stride_knh + d)  # (D,)
            v_new = tl.load(vn_ptr + row * stride_vnb + kvh * stride_vnh + d)
            spot = d * 0 + last  # (D,): a vector mask
            mine = (spot >= split * CHUNK) & (spot < split * CHUNK + CHUNK)
            tl.store(k_base + last * stride_kn + d, k_new, mask=mine)
            tl.store(v_base + last * stride_vn + d, v_new, mask=mine)
        for off in tl.static_range(0, CHUNK, BLOCK_N):
            n = split * CHUNK + off + tl.arange(0, BLOCK_N)
            valid = n < length
            k = tl.load(
                k_base + n[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0
            )
            if WRITE:
                k = tl.where((n == last)[:, None], k_new[None, :], k)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # (G_PAD, BLOCK_N)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + n[:, None] * stride_vn + d[None, :], mask=valid[:, None], other=0.0
            )
            if WRITE:
                v = tl.where((n == last)[:, None], v_new[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        at = (row * HEADS + heads) * SPLITS + split  # (G_PAD,)
        tl.store(m_ptr + at, m_i, mask=live)
        tl.store(l_ptr + at, l_i, mask=live)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=live[:, None])

    @triton.jit
    def _merge(
        m_ptr, l_ptr, acc_ptr, out_ptr,
        HEADS: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        """Combine a row's chunk partials for one query head; zeros for an empty row."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        base = (row * HEADS + head) * SPLITS
        present = s < SPLITS
        m = tl.load(m_ptr + base + s, mask=present, other=float("-inf"))
        lsum = tl.load(l_ptr + base + s, mask=present, other=0.0)
        acc = tl.load(
            acc_ptr + (base + s)[:, None] * D + d[None, :], mask=present[:, None], other=0.0
        )
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # (S_PAD,)
        total = tl.sum(lsum * w, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # (D,)
        tl.store(out_ptr + (row * HEADS + head) * D + d, out.to(out_ptr.dtype.element_ty))
