"""Clipped PPO surrogate with verl's dual clip, optionally importance-weighted (decoupled PPO)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from pipeline.algorithms.aggregation import LossAggMode, agg_loss
from pipeline.algorithms.masking import check_same_shape, masked_mean
from pipeline.errors import ConfigError

# Keeps exp() finite when the policy has drifted far from the sampling one (as verl).
_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Detached scalar tensors; kept on-device so logging does not force a sync per step."""

    clip_frac: Tensor  # share of valid tokens where the ratio clip was active
    clip_frac_lower: Tensor  # share of valid tokens capped by the dual clip (advantage < 0)
    approx_kl: Tensor  # masked mean of log pi_old - log pi (verl's ppo_kl)

    def as_dict(self, prefix: str = "actor/") -> dict[str, Tensor]:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    is_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossMetrics]:
    """PPO clipped surrogate as in verl's compute_policy_loss.

    The ratio pi/pi_old is clipped to [1 - low, 1 + high]. For negative advantages the plain
    clipped loss is unbounded as the ratio grows; the dual clip caps it at -A * clip_ratio_c
    (Ye et al., 2020). `None` disables the dual clip.

    Decoupled PPO (Hilton et al., 2022): pass the recomputed *proximal* log-probs as
    `old_logp` and truncated behaviour->proximal weights as `is_weights`; they multiply the
    per-token loss and are treated as constants.
    """
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ConfigError(
            f"set algorithm.clip_ratio_c to a value > 1 (got {clip_ratio_c}), or to null "
            "to disable the dual clip"
        )
    valid = mask.bool()  # (batch, seq)
    # Padding is replaced, not just masked out of the mean: a NaN there would otherwise reach
    # the gradient of logp as 0 * NaN.
    advantages = torch.where(valid, advantages, 0.0)
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # (batch, seq)
    log_ratio = torch.clamp(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)  # (batch, seq)
    loss_unclipped = -advantages * ratio  # (batch, seq)
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # (batch, seq)
    clipped = loss_clipped > loss_unclipped  # (batch, seq)
    lower_clipped = torch.zeros_like(clipped)  # (batch, seq)
    if clip_ratio_c is not None:
        loss_dual = -advantages * clip_ratio_c  # (batch, seq)
        negative = advantages < 0  # (batch, seq)
        lower_clipped = negative & (loss > loss_dual)
        loss = torch.where(negative, torch.minimum(loss, loss_dual), loss)
    if is_weights is not None:
        check_same_shape(is_weights=is_weights, mask=mask)
        loss = loss * torch.where(valid, is_weights.detach(), 0.0)
    with torch.no_grad():
        dtype = loss.dtype
        metrics = PolicyLossMetrics(
            clip_frac=masked_mean(clipped.to(dtype), mask),
            clip_frac_lower=masked_mean(lower_clipped.to(dtype), mask),
            approx_kl=masked_mean(-log_ratio, mask),
        )
    return agg_loss(loss, mask, loss_agg_mode), metrics
