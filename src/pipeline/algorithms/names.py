"""The algorithm's option names, without torch: the config validates them in processes
(the CLI, the supervisor) that never import torch."""

from __future__ import annotations

from typing import Literal, get_args

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

ISLevel = Literal["token", "sequence"]
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
