"""Per-token KL estimators between the policy and the frozen reference, and their two uses.

The estimators (Schulman, "Approximating KL divergence") take log-probs of tokens *sampled
from the policy*: k1 is unbiased but noisy and can be negative, k2 is low-variance but biased,
k3 is unbiased, non-negative and low-variance (verl's "low_var_kl").
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.algorithms.aggregation import agg_loss
from pipeline.algorithms.masking import check_same_shape, place_on_last_token
from pipeline.algorithms.names import KL_ESTIMATORS, KLEstimator, LossAggMode
from pipeline.errors import ConfigError

# verl's bounds: the log-ratio stays where exp() is finite, the estimate where gradients are sane.
_LOG_RATIO_BOUND = 20.0
_K3_BOUND = 10.0


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log pi - log pi_ref per token."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 * (log pi - log pi_ref)^2 per token."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1 per token, clamped to [-10, 10] like verl."""
    log_ratio = torch.clamp(ref_logp - logp, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    # expm1 keeps precision when the two policies are close, where exp(x) - 1 cancels.
    return torch.clamp(torch.expm1(log_ratio) - log_ratio, -_K3_BOUND, _K3_BOUND)


def check_kl_estimator(estimator: str, key: str = "algorithm.kl_estimator") -> None:
    """Validate eagerly so a typo fails at startup."""
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"unknown KL estimator {estimator!r}; set {key} to one of {', '.join(KL_ESTIMATORS)}"
        )


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL estimate (batch, seq) with the named estimator."""
    check_kl_estimator(estimator)
    if estimator == "k1":
        return kl_k1(logp, ref_logp)
    if estimator == "k2":
        return kl_k2(logp, ref_logp)
    return kl_k3(logp, ref_logp)


@torch.no_grad()
def kl_penalty_rewards(
    token_scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    coef: float,
    estimator: KLEstimator = "k1",
) -> tuple[Tensor, Tensor]:
    """Token rewards with the KL penalty folded in, and the masked per-token KL.

    `token_scores` is either one score per sequence (batch,), credited to the last valid
    token, or already per token (batch, seq). Returns (rewards, kl), both (batch, seq) and 0
    where masked; average `kl` with `masked_mean` to feed the KL controller.
    """
    check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    if token_scores.dim() == 1:
        scores = place_on_last_token(token_scores, mask)  # (batch, seq)
    else:
        check_same_shape(token_scores=token_scores, mask=mask)
        scores = token_scores  # (batch, seq)
    valid = mask.bool()  # (batch, seq)
    kl = torch.where(valid, kl_estimate(logp, ref_logp, estimator), 0.0)  # (batch, seq)
    rewards = torch.where(valid, scores - coef * kl, 0.0)  # (batch, seq)
    return rewards, kl


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    estimator: KLEstimator = "k3",
    loss_agg_mode: LossAggMode = "token-mean",
) -> Tensor:
    """Aggregated KL to the reference, differentiable in `logp` (the use_kl_loss path)."""
    check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    # KL is exactly 0 on padding, so garbage there cannot reach the gradient as 0 * NaN.
    ref_logp = torch.where(mask.bool(), ref_logp, logp.detach())
    return agg_loss(kl_estimate(logp, ref_logp, estimator), mask, loss_agg_mode)
