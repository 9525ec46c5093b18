"""Low-rank adapters (LoRA, Hu et al. 2021) on a decoder's linear layers.

`LoraLinear` is an `nn.Linear` whose weight and bias keep their names (so a state dict
of the base model still loads into it, and the merged weights go out under the names of a
full fine-tune) plus two trainable factors: y = x W^T + b + scaling * dropout(x) A^T B^T.
The update runs on the activations, not on a merged weight: the backward computes the
small factors' gradients, never the full weight's. Modules that concatenate several
projections into one GEMM (q|k|v, gate|up) add each adapter's output with `add_adapters`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LoraLinear(nn.Linear):
    """nn.Linear (frozen `weight`, `bias`) plus a trainable rank-r update (`lora_A`,
    `lora_B`); B starts at zero, so the adapted model starts as the base model."""

    lora_A: nn.Parameter  # (rank, in_features)
    lora_B: nn.Parameter  # (out_features, rank)
    scaling: float  # alpha / rank
    dropout: float
    # off: the base model (the reference's log-probs without a second copy of it)
    adapters_on: bool

    @classmethod
    def adapt(
        cls,
        linear: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float,
        generator: torch.Generator | None = None,
    ) -> LoraLinear:
        """A LoraLinear sharing `linear`'s weight and bias tensors (no copy)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        w = linear.weight
        a = torch.empty(rank, linear.in_features, dtype=w.dtype)
        # nn.Linear's (and peft's) init of A: kaiming-uniform with a = sqrt(5)
        bound = 1.0 / math.sqrt(linear.in_features)
        a.uniform_(-bound, bound, generator=generator)
        module.lora_A = nn.Parameter(a.to(w.device))
        module.lora_B = nn.Parameter(
            torch.zeros(linear.out_features, rank, dtype=w.dtype, device=w.device)
        )
        module.scaling = alpha / rank
        module.dropout = dropout
        module.adapters_on = True
        return module

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The adapter's output (..., out_features), None while adapters are off."""
        if not self.adapters_on:
            return None
        if self.dropout > 0 and self.training:
            x = F.dropout(x, self.dropout, training=True)
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        update = self.delta(x)
        return out if update is None else out + update

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling}"


def add_adapters(out: torch.Tensor, x: torch.Tensor, projs: Sequence[nn.Module]) -> torch.Tensor:
    """`out` = x through `projs` concatenated along the last dim (one GEMM over their
    weights), plus each adapter's update; `out` itself when none has an active adapter."""
    updates = [m.delta(x) if isinstance(m, LoraLinear) else None for m in projs]
    if all(u is None for u in updates):
        return out
    parts = [
        u if u is not None else out.new_zeros(*out.shape[:-1], cast_linear(m).out_features)
        for m, u in zip(projs, updates, strict=True)
    ]
    return out + torch.cat(parts, dim=-1)


def cast_linear(module: nn.Module) -> nn.Linear:
    assert isinstance(module, nn.Linear)
    return module
