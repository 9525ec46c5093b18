"""A service with an SM share below 100 checks that its forward repeats before its first
batch, and refuses the share, naming the setting, when it does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from pipeline.algorithms import AlgorithmConfig
from pipeline.config import load_config
from pipeline.log import get_logger
from pipeline.models import save_model
from pipeline.sm_share_check import (
    SHARE_ENV,
    SmShareRefused,
    check_repeatable,
    check_sm_share,
    sm_share,
)
from pipeline.training import CriticTrainer, PolicyTrainer, TrainerConfig

from ._helpers import make_model

SMALL = {
    "controller.prompts_per_step": "2",
    "rollout.n_samples": "2",
    "rollout.max_new_tokens": "6",
    "task.max_prompt_tokens": "5",
}


def test_the_share_is_read_from_the_mps_environment() -> None:
    assert sm_share({}) is None
    assert sm_share({SHARE_ENV: "100"}) is None  # the whole GPU: nothing to check
    assert sm_share({SHARE_ENV: "80"}) == 80


def test_a_policy_and_a_critic_that_repeat_pass(tmp_path: Path) -> None:
    """The real forwards on CPU (deterministic): both checked, each logged."""
    save_model(make_model(), tmp_path / "model")
    config = load_config("profiles/local-cpu.toml", SMALL)
    cpu = TrainerConfig(device="cpu")
    policy = PolicyTrainer(tmp_path / "model", cpu, AlgorithmConfig())
    critic = CriticTrainer(str(tmp_path / "model"), cpu, AlgorithmConfig())
    with capture_logs() as entries:
        check_sm_share(get_logger("test"), config, "critic", [critic], env={SHARE_ENV: "70"})
        check_sm_share(get_logger("test"), config, "learner", [policy], env={SHARE_ENV: "80"})
    checked = [(e["share"], e["what"]) for e in entries if e["event"] == "sm_share_checked"]
    assert checked == [(70, "values"), (80, "log-probs")]


def test_without_a_share_nothing_runs(tmp_path: Path) -> None:
    save_model(make_model(), tmp_path / "model")
    policy = PolicyTrainer(tmp_path / "model", TrainerConfig(device="cpu"), AlgorithmConfig())
    config = load_config("profiles/local-cpu.toml", SMALL)
    with capture_logs() as entries:
        check_sm_share(get_logger("test"), config, "learner", [policy], env={})
    assert entries == []


def test_results_that_differ_between_two_computations_refuse_the_share() -> None:
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(SmShareRefused, match=r"services\.learner\.gpu_share = 80: .* differ"):
        check_repeatable("learner", "log-probs", 80, lambda: torch.randn(64, generator=generator))


def test_non_finite_results_refuse_the_share() -> None:
    """NaN in the same place both times: not a difference, still refused."""
    nan = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(SmShareRefused, match=r"gpu_share = 70: .* SMs give 1 non-finite values"):
        check_repeatable("critic", "values", 70, lambda: nan.clone())
