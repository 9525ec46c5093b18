"""Every algorithm knob in one typed place, validated with messages that say how to fix it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from pipeline.algorithms.kl_controller import KLControllerType
from pipeline.algorithms.names import (
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ISLevel,
    KLEstimator,
    LossAggMode,
)
from pipeline.errors import ConfigError

AdvantageEstimator = Literal["gae", "vtrace", "grpo", "rloo"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
KL_CONTROLLER_TYPES: tuple[str, ...] = get_args(KLControllerType)

_SECTION = "algorithm"


@dataclass(frozen=True)
class AlgorithmConfig:
    """KL-regularised PPO settings; defaults follow verl where it has one."""

    # advantages
    advantage_estimator: AdvantageEstimator = "gae"
    # discount of GAE / V-trace
    gamma: float = 1.0
    # lambda of GAE / V-trace
    lam: float = 0.95
    # gae/vtrace advantages to zero mean, unit std over the step's tokens
    whiten_advantages: bool = True
    # GRPO divides by the group's std (off: Dr. GRPO's mean baseline)
    norm_adv_by_std_in_grpo: bool = True
    # policy loss
    clip_ratio_low: float = 0.2
    # PPO's upper clip of the ratio (1 + this)
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # dual clip for negative advantages; None disables it
    # token-mean, seq-mean-token-sum or seq-mean-token-mean
    loss_agg_mode: LossAggMode = "token-mean"
    # entropy bonus in the policy loss
    entropy_coef: float = 0.0
    # value loss
    value_clip: float | None = 0.5  # None disables value clipping
    # KL to the reference: as a loss term ...
    use_kl_loss: bool = False
    # weight of the KL-to-reference loss
    kl_loss_coef: float = 0.001
    # k1, k2, k3 or low_var_kl for the KL loss
    kl_estimator: KLEstimator = "k3"
    # ... and/or as a per-token reward penalty with a (possibly adaptive) coefficient
    kl_penalty_in_reward: bool = False
    # the estimator of the in-reward penalty
    kl_reward_estimator: KLEstimator = "k1"
    # fixed or adaptive coefficient of the in-reward penalty
    kl_ctrl_type: KLControllerType = "fixed"
    # the in-reward penalty's (starting) coefficient
    init_kl_coef: float = 0.001
    # the adaptive controller's target (mean per-sequence KL)
    target_kl: float = 0.1
    # samples over which the adaptive controller closes its error
    horizon: int = 10_000
    # rollout/learner mismatch: truncated importance sampling
    is_cap: float | None = 2.0  # None disables truncation
    # token or sequence truncated importance weights
    is_level: ISLevel = "token"
    # V-trace truncation levels (Espeholt et al. assume rho_bar >= c_bar)
    vtrace_rho_bar: float = 1.0
    # V-trace's trace-cutting truncation
    vtrace_c_bar: float = 1.0

    def validate(self) -> None:
        """Raise ConfigError naming the first bad key and a valid range for it."""
        _choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("kl_reward_estimator", self.kl_reward_estimator, KL_ESTIMATORS)
        _choice("kl_ctrl_type", self.kl_ctrl_type, KL_CONTROLLER_TYPES)
        _choice("is_level", self.is_level, IS_LEVELS)
        for key in (
            "whiten_advantages",
            "norm_adv_by_std_in_grpo",
            "use_kl_loss",
            "kl_penalty_in_reward",
        ):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"set {_SECTION}.{key} to true or false (got {getattr(self, key)!r})"
                )
        _number("gamma", self.gamma, low=0.0, high=1.0)
        _number("lam", self.lam, low=0.0, high=1.0)
        _number("clip_ratio_low", self.clip_ratio_low, low=0.0, high=1.0, high_open=True)
        _number("clip_ratio_high", self.clip_ratio_high, low=0.0)
        _number("clip_ratio_c", self.clip_ratio_c, low=1.0, low_open=True, optional=True)
        _number("value_clip", self.value_clip, low=0.0, low_open=True, optional=True)
        _number("entropy_coef", self.entropy_coef, low=0.0)
        _number("kl_loss_coef", self.kl_loss_coef, low=0.0)
        _number("init_kl_coef", self.init_kl_coef, low=0.0)
        _number("target_kl", self.target_kl, low=0.0, low_open=True)
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1:
            raise ConfigError(f"set {_SECTION}.horizon to an integer >= 1 (got {self.horizon!r})")
        if self.kl_ctrl_type == "adaptive" and self.init_kl_coef == 0:
            raise ConfigError(
                f"set {_SECTION}.init_kl_coef to a value > 0: the adaptive controller scales "
                "it multiplicatively, so 0 never changes (or set kl_ctrl_type = 'fixed')"
            )
        _number("is_cap", self.is_cap, low=0.0, low_open=True, optional=True)
        _number("vtrace_rho_bar", self.vtrace_rho_bar, low=0.0, low_open=True, finite=False)
        _number("vtrace_c_bar", self.vtrace_c_bar, low=0.0, low_open=True, finite=False)
        if self.vtrace_c_bar > self.vtrace_rho_bar:
            raise ConfigError(
                f"set {_SECTION}.vtrace_c_bar <= {_SECTION}.vtrace_rho_bar "
                f"(got c_bar={self.vtrace_c_bar}, rho_bar={self.vtrace_rho_bar}); "
                "V-trace's fixed point assumes rho_bar >= c_bar"
            )


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"set {_SECTION}.{key} to one of {', '.join(repr(a) for a in allowed)} (got {value!r})"
        )


def _number(
    key: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    finite: bool = True,
) -> None:
    """Check a numeric knob against [low, high] (with open ends where flagged)."""
    if value is None and optional:
        return
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    hint = (
        f"a number in {interval}"
        if high < math.inf
        else f"a number {'>' if low_open else '>='} {low:g}"
    )
    if optional:
        hint += " or null to disable"
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = not math.isnan(number) and (math.isfinite(number) or not finite)
        ok = ok and (number > low if low_open else number >= low)
        ok = ok and (number < high if high_open else number <= high)
    if not ok:
        raise ConfigError(f"set {_SECTION}.{key} to {hint} (got {value!r})")
