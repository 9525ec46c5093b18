from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline.algorithms import AlgorithmConfig
from pipeline.config import load_config
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid():
    AlgorithmConfig().validate()
    AlgorithmConfig(advantage_estimator="vtrace", kl_ctrl_type="adaptive").validate()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lam": 1.5}, "set algorithm.lam to a number in [0, 1]"),
        ({"gamma": -0.1}, "set algorithm.gamma to a number in [0, 1]"),
        ({"gamma": math.nan}, "algorithm.gamma"),
        ({"lam": "0.9"}, "algorithm.lam"),
        ({"clip_ratio_low": 1.0}, "set algorithm.clip_ratio_low to a number in [0, 1)"),
        ({"clip_ratio_high": -0.2}, "algorithm.clip_ratio_high"),
        ({"clip_ratio_c": 1.0}, "set algorithm.clip_ratio_c to a number > 1 or null"),
        ({"value_clip": 0.0}, "algorithm.value_clip"),
        ({"entropy_coef": -1e-3}, "algorithm.entropy_coef"),
        ({"kl_loss_coef": -1.0}, "algorithm.kl_loss_coef"),
        ({"kl_estimator": "k4"}, "set algorithm.kl_estimator to one of 'k1', 'k2', 'k3'"),
        ({"kl_reward_estimator": "mse"}, "algorithm.kl_reward_estimator"),
        ({"loss_agg_mode": "sum"}, "algorithm.loss_agg_mode"),
        ({"advantage_estimator": "ppo"}, "algorithm.advantage_estimator"),
        ({"kl_ctrl_type": "pid"}, "algorithm.kl_ctrl_type"),
        ({"target_kl": 0.0}, "algorithm.target_kl"),
        ({"horizon": 0}, "set algorithm.horizon to an integer >= 1"),
        ({"horizon": 10.5}, "algorithm.horizon"),
        ({"kl_ctrl_type": "adaptive", "init_kl_coef": 0.0}, "algorithm.init_kl_coef"),
        ({"is_cap": -1.0}, "algorithm.is_cap"),
        ({"is_level": "batch"}, "algorithm.is_level"),
        ({"use_kl_loss": 1}, "set algorithm.use_kl_loss to true or false"),
        ({"vtrace_rho_bar": 0.0}, "algorithm.vtrace_rho_bar"),
        ({"vtrace_c_bar": 2.0}, "set algorithm.vtrace_c_bar <= algorithm.vtrace_rho_bar"),
    ],
)
def test_invalid_values_say_how_to_fix(overrides, message):
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(**overrides).validate()
    assert message in str(info.value)


def test_optional_knobs_accept_null_and_infinite_bars():
    AlgorithmConfig(clip_ratio_c=None, value_clip=None, is_cap=None).validate()
    AlgorithmConfig(vtrace_rho_bar=math.inf, vtrace_c_bar=math.inf).validate()


def test_a_profile_algorithm_table_rejects_unknown_keys_and_validates():
    def load(**keys: str) -> AlgorithmConfig:
        overrides = {f"algorithm.{k}": v for k, v in keys.items()}
        return load_config(REPO / "profiles/local-cpu.toml", overrides).algorithm

    cfg = load(lam="0.9", advantage_estimator="grpo")
    assert cfg.lam == 0.9 and cfg.advantage_estimator == "grpo"
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.lamda'"):
        load(lamda="0.9")
    with pytest.raises(ConfigError, match=r"algorithm\.lam"):
        load(lam="2")
