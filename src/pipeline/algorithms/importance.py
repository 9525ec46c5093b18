"""Truncated importance weights between the rollout engine and the learner, and mismatch metrics.

The engine samples with its own kernels, precision and possibly stale weights, so its
log-probs (behaviour, mu) differ from the learner's (pi). Truncated IS corrects the bias
while the cap bounds the variance; the metrics show how far apart the two are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from pipeline.algorithms.kl import kl_k3
from pipeline.algorithms.masking import check_same_shape, masked_mean
from pipeline.algorithms.names import IS_LEVELS, ISLevel
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class MismatchMetrics:
    """Detached scalar tensors over the valid tokens."""

    kl: Tensor  # token-mean k3 estimate of KL(behaviour || learner), samples from behaviour
    mean_abs_diff: Tensor  # mean |log pi - log mu|
    max_abs_diff: Tensor  # max |log pi - log mu|
    truncated_frac: Tensor  # share of tokens whose weight hit the cap

    def as_dict(self, prefix: str = "mismatch/") -> dict[str, Tensor]:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}


def _log_ratio(
    learner_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: ISLevel
) -> Tensor:
    """log pi/mu per token (batch, seq), or per sequence broadcast to its tokens; 0 if masked."""
    check_same_shape(learner_logp=learner_logp, behaviour_logp=behaviour_logp, mask=mask)
    if level not in IS_LEVELS:
        raise ConfigError(
            f"unknown IS level {level!r}; set algorithm.is_level to one of {IS_LEVELS}"
        )
    log_ratio = torch.where(mask.bool(), learner_logp - behaviour_logp, 0.0)  # (batch, seq)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    return log_ratio


def _log_cap(cap: float | None) -> float:
    if cap is None:
        return math.inf
    if not cap > 0:
        raise ConfigError(f"set algorithm.is_cap to a value > 0 (got {cap}), or null for no cap")
    return math.log(cap)


@torch.no_grad()
def truncated_is_weights(
    learner_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
    level: ISLevel = "token",
) -> Tensor:
    """min(pi/mu, cap) per valid token (batch, seq), 0 where masked; no gradient.

    "sequence" uses the product of the sequence's token ratios for all of its tokens
    (unbiased for sequence-level objectives but of much higher variance). `cap=None` disables
    truncation.
    """
    log_ratio = _log_ratio(learner_logp, behaviour_logp, mask, level)  # (batch, seq)
    # Clamping in log space is min(exp(x), cap) without overflow for long sequences.
    weights = torch.exp(torch.clamp(log_ratio, max=_log_cap(cap)))  # (batch, seq)
    return torch.where(mask.bool(), weights, 0.0)


@torch.no_grad()
def mismatch_metrics(
    learner_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
    level: ISLevel = "token",
) -> MismatchMetrics:
    """How far the engine's log-probs are from the learner's, over the valid tokens."""
    log_ratio = _log_ratio(learner_logp, behaviour_logp, mask, level)  # (batch, seq)
    valid = mask.bool()  # (batch, seq)
    abs_diff = torch.where(valid, (learner_logp - behaviour_logp).abs(), 0.0)  # (batch, seq)
    dtype = abs_diff.dtype
    return MismatchMetrics(
        kl=masked_mean(kl_k3(behaviour_logp, learner_logp), mask),
        mean_abs_diff=masked_mean(abs_diff, mask),
        max_abs_diff=abs_diff.amax() if abs_diff.numel() else abs_diff.new_zeros(()),
        truncated_frac=masked_mean((log_ratio > _log_cap(cap)).to(dtype), mask),
    )
