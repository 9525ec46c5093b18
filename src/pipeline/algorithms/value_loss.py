"""Clipped value loss: the critic may not move further than the clip range from its old guess."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from pipeline.algorithms.aggregation import LossAggMode, agg_loss
from pipeline.algorithms.masking import check_same_shape, masked_mean
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class ValueLossMetrics:
    """Detached scalar tensors."""

    clip_frac: Tensor  # share of valid tokens where the clipped error was the larger one

    def as_dict(self, prefix: str = "critic/") -> dict[str, Tensor]:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = 0.5,
    loss_agg_mode: LossAggMode = "token-mean",
) -> tuple[Tensor, ValueLossMetrics]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old +- c) - R)^2)), as verl's compute_value_loss.

    Taking the max makes the clip pessimistic: it only ever removes gradient that would move V
    beyond the trust region, never adds any. `clip_range=None` gives the plain squared error.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    valid = mask.bool()  # (batch, seq)
    # Padding targets are replaced so a NaN there cannot reach the gradient as 0 * NaN.
    returns = torch.where(valid, returns, 0.0)
    old_values = torch.where(valid, old_values, 0.0)
    error = (values - returns).square()  # (batch, seq)
    if clip_range is None:
        loss_mat = error
        clipped = torch.zeros_like(error, dtype=torch.bool)
    else:
        if not clip_range > 0:
            raise ConfigError(
                f"set algorithm.value_clip to a value > 0 (got {clip_range}), or to null "
                "to disable value clipping"
            )
        values_clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        error_clipped = (values_clipped - returns).square()  # (batch, seq)
        loss_mat = torch.maximum(error, error_clipped)
        clipped = error_clipped > error
    with torch.no_grad():
        metrics = ValueLossMetrics(clip_frac=masked_mean(clipped.to(loss_mat.dtype), mask))
    return 0.5 * agg_loss(loss_mat, mask, loss_agg_mode), metrics
