"""KL coefficient controllers for the in-reward KL penalty (Ziegler et al., 2019)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.algorithms.config import AlgorithmConfig

KLControllerType = Literal["fixed", "adaptive"]

# Ziegler et al. clip the proportional error so one noisy batch moves beta by at most 20%/horizon.
_MAX_PROPORTIONAL_ERROR = 0.2


@dataclass(frozen=True)
class FixedKLConfig:
    """A constant KL coefficient."""

    kl_coef: float = 0.001

    def __post_init__(self) -> None:
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ConfigError(f"set algorithm.init_kl_coef to a value >= 0 (got {self.kl_coef})")


@dataclass(frozen=True)
class AdaptiveKLConfig:
    """A KL coefficient steered towards `target_kl` over roughly `horizon` samples."""

    init_kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_kl_coef) and self.init_kl_coef > 0):
            raise ConfigError(
                f"set algorithm.init_kl_coef to a value > 0 for the adaptive controller "
                f"(got {self.init_kl_coef}); 0 could never grow"
            )
        if not (math.isfinite(self.target_kl) and self.target_kl > 0):
            raise ConfigError(f"set algorithm.target_kl to a value > 0 (got {self.target_kl})")
        if not self.horizon > 0:
            raise ConfigError(f"set algorithm.horizon to a value > 0 (got {self.horizon})")


class KLController(Protocol):
    """What the trainer needs: the current coefficient and a per-batch update."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Keeps the coefficient constant; `update` exists so trainers need not special-case it."""

    def __init__(self, config: FixedKLConfig) -> None:
        self.value = float(config.kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon after each batch."""

    def __init__(self, config: AdaptiveKLConfig) -> None:
        self.value = float(config.init_kl_coef)
        self.target = float(config.target_kl)
        self.horizon = float(config.horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """`current_kl` is the batch's mean per-sequence KL; `n_steps` its number of samples."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            # A NaN would silently poison every later reward; fail where it first shows.
            raise ValueError(f"KL controller got a non-finite KL ({current_kl}); check the batch")
        if n_steps < 0:
            raise ValueError(f"KL controller got n_steps={n_steps}; expected >= 0")
        error = current_kl / self.target - 1.0
        error = min(max(error, -_MAX_PROPORTIONAL_ERROR), _MAX_PROPORTIONAL_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(config: AlgorithmConfig) -> FixedKLController | AdaptiveKLController:
    """Build the controller the config names (`algorithm.kl_ctrl_type`)."""
    if config.kl_ctrl_type == "fixed":
        return FixedKLController(FixedKLConfig(kl_coef=config.init_kl_coef))
    if config.kl_ctrl_type == "adaptive":
        return AdaptiveKLController(
            AdaptiveKLConfig(
                init_kl_coef=config.init_kl_coef,
                target_kl=config.target_kl,
                horizon=config.horizon,
            )
        )
    raise ConfigError(
        f"unknown KL controller {config.kl_ctrl_type!r}; "
        "set algorithm.kl_ctrl_type to 'fixed' or 'adaptive'"
    )
