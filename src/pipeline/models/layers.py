"""Small building blocks of the decoder: RMSNorm, rotary embedding, SwiGLU MLP.

The arithmetic (float32 normalisation, cos/sin computed in float32 then cast) follows
transformers exactly so that native and HF logits agree to float32 round-off.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.config import ModelConfig, RopeScaling
from pipeline.models.lora import add_adapters
from pipeline.models.swiglu_kernel import swiglu_packed


class RMSNorm(nn.Module):
    """Normalises in float32 because bf16 mean-of-squares loses too much precision."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, self(s)) with s = x + delta (x without delta), by the one-pass op of
        models/norm_kernel.py: the residual add fused into the norm, both ways."""
        from pipeline.models.norm_kernel import add_rms_norm

        return add_rms_norm(x, delta, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), float32, with optional llama3/linear scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    assert scaling.original_max_position_embeddings is not None
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds inv_freq as a non-persistent buffer so checkpoints carry no RoPE tensors."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        self.register_buffer(
            "inv_freq", rope_inv_freq(self.head_dim, self.theta, self.scaling), persistent=False
        )

    def reset_parameters(self) -> None:
        """Recompute inv_freq, e.g. after `to_empty` left it uninitialised."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(
            self.inv_freq.device
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (*positions.shape, head_dim); negative positions are treated as 0."""
        pos = positions.clamp(min=0).float()
        freqs = pos[..., None] * self.inv_freq.float()  # (..., head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, s, heads, head_dim); cos/sin: (b, s, head_dim)."""
    cos = cos.unsqueeze(2)  # (b, s, 1, head_dim)
    sin = sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def rows_follow(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b`'s rows are stored right after `a`'s in one storage (both contiguous, one
    width and dtype): then `AdjacentRows` may view them as one tensor."""
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype
        and a.shape[1:] == b.shape[1:]
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    )


def all_rows_follow(parts: Sequence[torch.Tensor]) -> bool:
    """`rows_follow` for each consecutive pair: the parts lie back to back in one storage."""
    return all(rows_follow(a, b) for a, b in itertools.pairwise(parts))


class AdjacentRows(torch.autograd.Function):
    """[a; b] as a view of their shared storage where `rows_follow(a, b)`; the gradient
    splits back into views. The caller checks that once (`check_adjacent` of SwiGLU and
    Attention): it is not traceable, so here it is checked only when running eagerly.
    (Two operands: dynamo traced a variadic forward wrongly on a recompile.)"""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and not rows_follow(a, b):
            raise ValueError("AdjacentRows: the tensors are not stored one after the other")
        ctx.rows = a.shape[0]
        return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad[: ctx.rows], grad[ctx.rows :]


def adjacent_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """[p0; p1; ...] as one view where `all_rows_follow(parts)`: AdjacentRows pair by pair
    (each view ends where the next part starts)."""
    out = parts[0]
    for part in parts[1:]:
        out = AdjacentRows.apply(out, part)
    return out


def adjacent_order(model: nn.Module) -> list[nn.Parameter]:
    """`model.parameters()` with each module's `row_groups()` (SwiGLU's gate and up weights,
    Attention's q/k/v weights and biases) moved together, at the first member's place: a
    flat buffer laid out in this order stores each group back to back."""
    follow: dict[int, list[nn.Parameter]] = {}
    later: set[int] = set()
    for module in model.modules():
        if isinstance(module, RowGrouped):
            for group in module.row_groups():
                follow[id(group[0])] = group
                later.update(id(p) for p in group[1:])
    order: list[nn.Parameter] = []
    for p in model.parameters():
        if id(p) not in later:
            order.extend(follow.get(id(p), [p]))
    return order


@runtime_checkable
class RowGrouped(Protocol):
    """A module whose weights may run as one tensor when stored back to back (SwiGLU's gate
    and up, Attention's q/k/v): `adjacent_order` lays them out so, and whoever moved them
    into one flat buffer calls `check_adjacent` after."""

    def row_groups(self) -> list[list[nn.Parameter]]: ...

    def check_adjacent(self) -> None: ...


class SwiGLU(nn.Module):
    """Gated MLP shared by all three families (HF names gate_proj/up_proj/down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # set by `fuse_projections`: gate and up weights as views of one tensor
        self.gate_up_weight: torch.Tensor | None = None
        # set by the trainer (`trainer.packed_mlp`): gate and up as one GEMM over their
        # concatenated weights, SwiGLU by the one-pass op of swiglu_kernel.py; `adjacent`:
        # up's weight is stored right after gate's (views of one flat buffer), so their
        # concatenation is a view (`AdjacentRows`) instead of a copy
        self.packed = False
        self.adjacent = False

    def row_groups(self) -> list[list[nn.Parameter]]:
        return [[cast(nn.Parameter, p) for p in (self.gate_proj.weight, self.up_proj.weight)]]

    def check_adjacent(self) -> None:
        """Set `adjacent` from where the gate and up weights are stored now (a caller that
        moves them into one flat buffer calls this after)."""
        self.adjacent = self.packed and all_rows_follow(self.row_groups()[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:  # one GEMM instead of two (engines)
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        if self.packed:
            pair = (self.gate_proj.weight, self.up_proj.weight)
            weight = AdjacentRows.apply(*pair) if self.adjacent else torch.cat(pair)
            gate_up = add_adapters(F.linear(x, weight), x, (self.gate_proj, self.up_proj))
            return self.down_proj(swiglu_packed(gate_up))
        # two GEMMs and inductor's SwiGLU: with one concatenated weight the compiled backward
        # writes d(gate, up) through the split's view, much slower (docs/performance.md)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
