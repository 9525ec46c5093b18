"""Pure torch RL math on (batch, seq) tensors with a mask of valid response tokens.

Every function takes masks as bool or float (float acts as per-token weights in means),
ignores whatever the masked positions hold, and returns 0 there.
"""

# lazy (PEP 562): the config imports pipeline.algorithms.config, and the CLI must not
# import torch through this package
from __future__ import annotations

import importlib
from typing import Any

_SOURCES = {
    "ADVANTAGE_ESTIMATORS": "config",
    "AdaptiveKLConfig": "kl_controller",
    "AdaptiveKLController": "kl_controller",
    "AdvantageEstimator": "config",
    "AlgorithmConfig": "config",
    "FixedKLConfig": "kl_controller",
    "FixedKLController": "kl_controller",
    "KLController": "kl_controller",
    "KLEstimator": "names",
    "KL_ESTIMATORS": "names",
    "LOSS_AGG_MODES": "names",
    "LossAggMode": "names",
    "MismatchMetrics": "importance",
    "PolicyLossMetrics": "policy_loss",
    "ValueLossMetrics": "value_loss",
    "agg_loss": "aggregation",
    "clipped_value_loss": "value_loss",
    "compute_gae": "gae",
    "compute_vtrace": "vtrace",
    "entropy_bonus_loss": "entropy",
    "grpo_advantages": "advantages",
    "kl_estimate": "kl",
    "kl_k1": "kl",
    "kl_k2": "kl",
    "kl_k3": "kl",
    "kl_loss": "kl",
    "kl_penalty_rewards": "kl",
    "make_kl_controller": "kl_controller",
    "masked_mean": "masking",
    "masked_sum": "masking",
    "masked_var": "masking",
    "masked_whiten": "advantages",
    "mismatch_metrics": "importance",
    "place_on_last_token": "masking",
    "ppo_policy_loss": "policy_loss",
    "rloo_advantages": "advantages",
    "token_entropy": "entropy",
    "truncated_is_weights": "importance",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
