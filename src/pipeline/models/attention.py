"""Grouped-query self-attention with RoPE, optional q/k/v bias and optional q/k RMSNorm.

One module serves every mode (dense causal, padded, packed, KV-cached); the mode travels in an
`AttentionSpec` so the decoder block has a single forward that FSDP hooks, activation
checkpointing and torch.compile all wrap the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.models.config import ModelConfig
from pipeline.models.decode_attention import decode_attention
from pipeline.models.kv_cache import KVCache
from pipeline.models.layers import RMSNorm, adjacent_rows, all_rows_follow, apply_rope
from pipeline.models.lora import add_adapters
from pipeline.models.rope_kernel import rope_qkv


@dataclass
class AttentionSpec:
    """How to attend.

    mask: (b, 1, q, k) bool, True = may attend; None means plain causal (is_causal=True).
    cu_seqlens/max_seqlen: packed sequences (batch 1) run through flash varlen attention
    (CUDA, half precision) with no mask at all; set only where `varlen_supported` said so.
    grouped: the varlen kernel takes k/v with fewer heads as they are (`varlen_grouped`).
    rows: the packed row (batch 1) is `rows` sequences of one length back to back; they
    attend as a (rows, length) causal batch, by cuDNN's kernel where `cudnn` says it serves
    (`cudnn_rows_supported`), else by SDPA. No mask, no cu_seqlens.
    cache/slots/columns/kv_len: set only on the KV-cache path; columns (b, t) are the cache
    columns to write (padding already redirected to the sink; None on a kernel decode step,
    whose kernel writes) and kv_len the columns to read.
    decode_lengths (b,): a decode step (t = 1) served by the in-place Triton kernel
    (models.decode_attention) over each row's first decode_lengths columns, with no mask.
    """

    mask: torch.Tensor | None = None
    cache: KVCache | None = None
    slots: torch.Tensor | None = None
    columns: torch.Tensor | None = None
    kv_len: int = 0
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    grouped: bool = False
    decode_lengths: torch.Tensor | None = None
    rows: int = 0
    cudnn: bool = False


class Attention(nn.Module):
    """HF-named projections (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, hd = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        # the engine sets `eager_attend(self)` before compiling a block for decoding
        self.attend_fn: Callable[..., torch.Tensor] = attend
        # set by `fuse_projections`: q/k/v weights (and biases) as views of one tensor
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        # set by the trainer (`trainer.fused_rope`): RoPE by the one-pass op of rope_kernel.py
        self.fused_rope = False
        # q/k/v weights (biases) stored back to back (views of one flat buffer: see
        # `check_adjacent`), so their concatenation is a view (`AdjacentRows`), not a copy
        self.adjacent = False
        self.adjacent_bias = False

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        b, s, _ = x.shape  # (batch, seq, hidden)
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        weight, bias = self.qkv_weight, self.qkv_bias
        if weight is None:  # concatenated per call (a few MB): still one GEMM, and one per
            weight, bias = self._concat_qkv()  # gradient, instead of three narrow ones
        qkv = F.linear(x, weight, bias)  # (batch, seq, nq + 2 nk)
        qkv = add_adapters(qkv, x, (self.q_proj, self.k_proj, self.v_proj))
        if self.fused_rope and self.q_norm is None:
            q, k, v = self._fused_rope(qkv, cos, sin)
        else:
            q, k, v = qkv.split([nq, nk, nk], dim=-1)
            q = q.reshape(b, s, self.num_heads, self.head_dim)
            k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
            v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rope(q, cos, sin)  # (batch, seq, heads, head_dim)
            k = apply_rope(k, cos, sin)  # (batch, seq, kv_heads, head_dim)
        return self.o_proj(self.attend_fn(self, q, k, v, spec))  # (batch, seq, hidden)

    def _fused_rope(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated and v by the one-pass op: (batch, seq, heads, head_dim) each."""
        b, s, _ = qkv.shape
        flat = (qkv.reshape(b * s, -1), cos.reshape(b * s, -1), sin.reshape(b * s, -1))
        out = rope_qkv(*flat, self.num_heads, self.num_kv_heads)  # (b * s, heads, head_dim)
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in out)
        return q, k, v

    def row_groups(self) -> list[list[nn.Parameter]]:
        """The q/k/v weights, then their biases where all three have one."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        groups = [[cast(nn.Parameter, m.weight) for m in projs]]
        biases = [m.bias for m in projs]
        if all(b is not None for b in biases):
            groups.append(biases)
        return groups

    def check_adjacent(self) -> None:
        """Set `adjacent` (`adjacent_bias`) from where the q/k/v weights (biases) are stored
        now. (A flat buffer aligns each tensor's start: biases whose sizes are not multiples
        of its alignment are not adjacent there.)"""
        groups = self.row_groups()
        self.adjacent = all_rows_follow(groups[0])
        self.adjacent_bias = len(groups) > 1 and all_rows_follow(groups[1])

    def _concat_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weights = [m.weight for m in projs]
        # (nq + 2 nk, hidden)
        weight = adjacent_rows(weights) if self.adjacent else torch.cat(weights)
        biases = [m.bias for m in projs]
        if all(b is None for b in biases):
            return weight, None
        if self.adjacent_bias:
            return weight, adjacent_rows(biases)  # type: ignore[arg-type]
        bias = torch.cat(
            [
                b if b is not None else m.weight.new_zeros(m.out_features)
                for m, b in zip(projs, biases, strict=True)
            ]
        )
        return weight, bias


def attend(
    attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> torch.Tensor:
    """Attention proper (cache write/read included): (batch, seq, heads * head_dim)."""
    b, s = q.shape[:2]
    if spec.rows:
        return rows_causal(q, k, v, spec.rows, cudnn=spec.cudnn)
    if spec.cu_seqlens is not None:
        if q.dtype in (torch.bfloat16, torch.float16):
            # (1, seq, ...) -> (seq, ...) as views: a select (q[0]) has a backward that
            # copies the gradient into a fresh buffer
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            out = varlen_causal(q, k, v, spec.cu_seqlens, spec.max_seqlen, grouped=spec.grouped)
            return out.reshape(b, s, attn.num_heads * attn.head_dim)
        if spec.mask is None:  # fp32 on CUDA: flash has no fp32 kernel; mask once per pass
            from pipeline.models.masks import packed_causal_mask

            spec.mask = packed_causal_mask(spec.cu_seqlens, s)
    if spec.cache is not None:
        assert spec.slots is not None
        cache, layer = spec.cache, attn.layer_idx
        if spec.decode_lengths is not None:  # in place, no gather, no mask
            out = decode_attention(
                q[:, 0].to(cache.k.dtype),  # (batch, heads, head_dim)
                cache.k[layer],
                cache.v[layer],
                spec.slots,
                spec.decode_lengths,
                spec.kv_len,
                # the kernel writes this step's keys and values: no index_put pair per layer
                new=(k[:, 0].to(cache.k.dtype), v[:, 0].to(cache.v.dtype)),
            )
            return out.to(q.dtype).reshape(b, s, attn.num_heads * attn.head_dim)
        assert spec.columns is not None
        cache.write(layer, spec.slots, spec.columns, k, v)
        k, v = cache.read(layer, spec.slots, spec.kv_len, q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (batch, heads, seq, head_dim)
        k.transpose(1, 2),  # (batch, kv_heads, kv_seq, head_dim)
        v.transpose(1, 2),
        attn_mask=spec.mask,
        is_causal=spec.mask is None and spec.cache is None and spec.cu_seqlens is None,
        enable_gqa=attn.num_kv_heads != attn.num_heads,
    )  # (batch, heads, seq, head_dim)
    return out.transpose(1, 2).reshape(b, s, attn.num_heads * attn.head_dim)


def rows_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, *, cudnn: bool
) -> torch.Tensor:
    """Causal attention over a packed row (1, T, heads, d) that holds `rows` sequences of
    T / rows tokens each: the same row viewed as a (rows, T / rows) batch, no copies.
    cudnn: `cudnn_rows_supported` said yes (used for half precision). Returns
    (1, T, heads * d)."""
    b, s, heads, d = q.shape
    cudnn = cudnn and q.dtype in (torch.bfloat16, torch.float16)
    if cudnn:  # the layout the probe checked: v may be a strided slice of the projection
        q, k, v = (t.contiguous() for t in (q, k, v))
    qd, kd, vd = (t.view(rows, -1, t.shape[2], d).transpose(1, 2) for t in (q, k, v))
    if cudnn:  # k/v keep their own heads
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qd, kd, vd, None, need_lse, 0.0, True, False
        )[0]
    else:
        out = F.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, enable_gqa=kd.shape[1] != heads
        )  # (rows, heads, length, d)
    return out.transpose(1, 2).reshape(b, s, heads * d)


@functools.cache
def cudnn_rows_supported(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> bool:
    """Whether cuDNN's fused attention serves `rows_causal` on `device` in `dtype` for heads
    of `head_dim`: CUDA half precision with cuDNN SDPA enabled, checked once per key,
    forward and backward with grouped k/v heads, against SDPA's math kernel (torch 2.11's
    ragged cuDNN backward returned wrong dq/dk in a probe, so a capability flag
    alone is not trusted). Call it outside torch.compile."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not torch.backends.cudnn.is_available() or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    q, k, v = _probe_inputs(device, dtype, (1, 96), head_dim)

    def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return rows_causal(q, k, v, 3, cudnn=False)

    return _agrees(lambda q, k, v: rows_causal(q, k, v, 3, cudnn=True), math, (q, k, v), 3e-2)


def _probe_inputs(
    device: torch.device, dtype: torch.dtype, lead: tuple[int, ...], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded q with 4 heads and k, v with 2 (grouped), shaped lead + (heads, head_dim)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(*lead, h, head_dim, device=device, dtype=dtype, generator=gen)
        for h in (4, 2, 2)
    )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def _agrees(
    run: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tol: float,
) -> bool:
    """Whether `run` gives `reference`'s output and q/k/v gradients within `tol` (a kernel
    probe); False where `run` raises."""
    try:
        got = run(*qkv)
        grads = torch.autograd.grad(got.float().square().sum(), qkv)
    except (RuntimeError, ValueError, TypeError):
        return False
    want = reference(*qkv)
    wants = torch.autograd.grad(want.float().square().sum(), qkv)
    return all(
        a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
        for a, b in zip((got, *grads), (want, *wants), strict=True)
    )


def eager_attend(attn: Attention) -> None:
    """Keep `attend` out of torch.compile for this module: a compiled block then breaks its
    graph around the in-place KV-cache write and the attention kernel, and fuses everything
    before and after (projections, norms, RoPE, MLP)."""
    attn.attend_fn = torch.compiler.disable(attend)


def varlen_supported(device: torch.device) -> bool:
    """Flash varlen attention exists for CUDA tensors (half precision; torch >= 2.9)."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    grouped: bool = False,
) -> torch.Tensor:
    """Causal attention inside each packed sequence: q (T, heads, d), k/v (T, kv_heads, d).
    grouped: k/v go in with their own heads (`varlen_grouped` said the kernel takes them);
    otherwise they are repeated to the query heads."""
    from torch.nn.attention.varlen import varlen_attn

    causal, gqa_flag = _varlen_options()
    extra: dict[str, Any] = dict(causal)
    if k.shape[1] != q.shape[1]:
        if not grouped:
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        elif gqa_flag:
            extra["enable_gqa"] = True
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **extra)  # (T, heads, d)
    return cast(torch.Tensor, out)


_OPTIONS: list[tuple[dict[str, Any], bool]] = []


def _varlen_options() -> tuple[dict[str, Any], bool]:
    """How this torch's varlen_attn says "causal", and whether it has an `enable_gqa` flag
    (read once: the signature changed between releases). Filled by `varlen_grouped` before
    the compiled trunk runs, which then reads a plain global (torch.compile warns about
    tracing through a functools cache)."""
    if not _OPTIONS:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        causal: dict[str, Any] = (
            {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        )
        _OPTIONS.append((causal, "enable_gqa" in params))
    return _OPTIONS[0]


@functools.cache
def varlen_grouped(device: torch.device) -> bool:
    """Whether varlen attention on `device` takes fewer k/v heads than query heads as they
    are: with its `enable_gqa` flag where it has one, else (torch 2.11, whose flash kernels
    group heads but whose wrapper has no flag) when a probe, forward and backward, matches
    repeated heads. Call it outside torch.compile. Repeating costs a copy of k and v per
    layer and a group sum in the backward, which inductor fused into the RoPE backward:
    slower than that kernel plus the group sums inside the flash backward when grouped
    (kernel traces of learner_step: docs/performance.md)."""
    if _varlen_options()[1]:
        return True
    from torch.nn.attention.varlen import varlen_attn

    causal, _ = _varlen_options()
    q, k, v = _probe_inputs(device, torch.bfloat16, (24,), 64)
    cu = torch.tensor([0, 9, 24], device=device, dtype=torch.int32)

    def repeated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return cast(torch.Tensor, varlen_attn(q, kr, vr, cu, cu, 15, 15, **causal))

    def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, varlen_attn(q, k, v, cu, cu, 15, 15, **causal))

    return _agrees(grouped, repeated, (q, k, v), 2e-2)
