"""Reduce a (batch, seq) loss matrix to a scalar; the mode decides how long answers weigh."""

from __future__ import annotations

from torch import Tensor

from pipeline.algorithms.masking import masked_mean, masked_sum
from pipeline.algorithms.names import LOSS_AGG_MODES, LossAggMode
from pipeline.errors import ConfigError


def check_loss_agg_mode(loss_agg_mode: str) -> None:
    """Validate eagerly so a typo fails at startup, not at the first loss computation."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; "
            f"set algorithm.loss_agg_mode to one of {', '.join(LOSS_AGG_MODES)}"
        )


def agg_loss(loss_mat: Tensor, mask: Tensor, loss_agg_mode: LossAggMode = "token-mean") -> Tensor:
    """Aggregate per-token losses with verl's `agg_loss` semantics.

    "token-mean" weighs every token equally (long answers dominate); the "seq-mean-*" modes
    weigh every sequence equally. Sequences without a valid token are left out of seq-means
    instead of pulling the mean towards 0.
    """
    check_loss_agg_mode(loss_agg_mode)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)  # (batch,)
    else:
        per_seq = masked_mean(loss_mat, mask, dim=-1)  # (batch,)
    has_tokens = mask.bool().any(dim=-1)  # (batch,)
    return masked_mean(per_seq, has_tokens)
