from __future__ import annotations

import math

import pytest

from pipeline.algorithms import (
    AdaptiveKLConfig,
    AdaptiveKLController,
    AlgorithmConfig,
    FixedKLConfig,
    FixedKLController,
    make_kl_controller,
)
from pipeline.errors import ConfigError


def test_fixed_controller_never_moves():
    ctl = FixedKLController(FixedKLConfig(kl_coef=0.05))
    for kl in (0.0, 1.0, 100.0):
        ctl.update(kl, n_steps=512)
    assert ctl.value == 0.05


def test_adaptive_first_step_by_hand():
    # Ziegler et al.: err = clip(12 / 6 - 1, -0.2, 0.2) = 0.2; beta = 0.2 * (1 + 0.2 * 256 / 10000)
    ctl = AdaptiveKLController(AdaptiveKLConfig(init_kl_coef=0.2, target_kl=6.0, horizon=10000))
    ctl.update(12.0, n_steps=256)
    assert ctl.value == pytest.approx(0.201024, rel=1e-12)


def test_adaptive_update_sequence():
    cfg = AdaptiveKLConfig(init_kl_coef=0.1, target_kl=0.5, horizon=1000)
    ctl = AdaptiveKLController(cfg)
    steps = [(0.5, 64), (0.55, 64), (2.0, 128), (0.0, 32), (0.45, 64), (0.6, 0), (0.1, 256)]
    beta = 0.1
    for kl, n in steps:
        err = kl / 0.5 - 1
        if err > 0.2:
            err = 0.2
        if err < -0.2:
            err = -0.2
        beta = beta * (1 + err * n / 1000)
        ctl.update(kl, n_steps=n)
        assert ctl.value == pytest.approx(beta, rel=1e-12)
    # the clipped steps bounded the total movement
    assert 0.1 * 0.8**3 < ctl.value < 0.1 * 1.2**3


def test_adaptive_rejects_non_finite_kl():
    ctl = AdaptiveKLController(AdaptiveKLConfig())
    with pytest.raises(ValueError, match="non-finite"):
        ctl.update(math.nan, n_steps=8)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"target_kl": 0.0}, "target_kl"),
        ({"horizon": 0}, "horizon"),
        ({"init_kl_coef": -1.0}, "init_kl_coef"),
    ],
)
def test_adaptive_config_validation(kwargs, key):
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}"):
        AdaptiveKLConfig(**kwargs)


def test_factory_follows_algorithm_config():
    fixed = make_kl_controller(AlgorithmConfig(init_kl_coef=0.02))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.02
    adaptive = make_kl_controller(
        AlgorithmConfig(kl_ctrl_type="adaptive", init_kl_coef=0.02, target_kl=1.0, horizon=100)
    )
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(2.0, n_steps=10)
    assert adaptive.value == pytest.approx(0.02 * 1.02, rel=1e-12)
