"""Pure torch RL math on (batch, seq) tensors with a mask of valid response tokens.

Every function takes masks as bool or float (float acts as per-token weights in means),
ignores whatever the masked positions hold, and returns 0 there.
"""

from pipeline.algorithms.advantages import grpo_advantages, masked_whiten, rloo_advantages
from pipeline.algorithms.aggregation import LOSS_AGG_MODES, LossAggMode, agg_loss
from pipeline.algorithms.config import ADVANTAGE_ESTIMATORS, AdvantageEstimator, AlgorithmConfig
from pipeline.algorithms.entropy import entropy_bonus_loss, token_entropy
from pipeline.algorithms.gae import compute_gae
from pipeline.algorithms.importance import (
    MismatchMetrics,
    mismatch_metrics,
    truncated_is_weights,
)
from pipeline.algorithms.kl import (
    KL_ESTIMATORS,
    KLEstimator,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_penalty_rewards,
)
from pipeline.algorithms.kl_controller import (
    AdaptiveKLConfig,
    AdaptiveKLController,
    FixedKLConfig,
    FixedKLController,
    KLController,
    make_kl_controller,
)
from pipeline.algorithms.masking import masked_mean, masked_sum, masked_var, place_on_last_token
from pipeline.algorithms.policy_loss import PolicyLossMetrics, ppo_policy_loss
from pipeline.algorithms.value_loss import ValueLossMetrics, clipped_value_loss
from pipeline.algorithms.vtrace import compute_vtrace

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLConfig",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AlgorithmConfig",
    "FixedKLConfig",
    "FixedKLController",
    "KLController",
    "KLEstimator",
    "LossAggMode",
    "MismatchMetrics",
    "PolicyLossMetrics",
    "ValueLossMetrics",
    "agg_loss",
    "clipped_value_loss",
    "compute_gae",
    "compute_vtrace",
    "entropy_bonus_loss",
    "grpo_advantages",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty_rewards",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "place_on_last_token",
    "ppo_policy_loss",
    "rloo_advantages",
    "token_entropy",
    "truncated_is_weights",
]
