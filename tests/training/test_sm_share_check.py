"""A service with an SM share below 100 checks its matrix products and that its forward
repeats before its first batch, and refuses the share, naming the setting, when either
fails."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    check_products,
    check_repeatable,
    check_sm_share,
    product_shapes,
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
    assert checked == [
        (70, "matrix products"),
        (70, "values"),
        (80, "matrix products"),
        (80, "log-probs"),
    ]


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


def test_the_products_checked_are_the_layers_at_the_micro_batch_sizes(tmp_path: Path) -> None:
    """Every 2-D weight at the training and the no-grad token counts; the output layer's
    (vocabulary rows) at its log-prob chunk, and at the training count where its logits are
    kept for backward."""
    save_model(make_model(), tmp_path / "model")
    cpu = TrainerConfig(
        device="cpu",
        max_tokens_per_micro_batch=96,
        infer_max_tokens_per_micro_batch=160,
        logprob_chunk_tokens=32,
    )
    policy = PolicyTrainer(tmp_path / "model", cpu, AlgorithmConfig())
    model = policy.model
    vocab = model.config.vocab_size
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes = product_shapes(policy)
    assert {(out, inner) for _, inner, out in shapes} == weights
    assert {rows for rows, _, out in shapes if out == vocab} == {32}
    assert {rows for rows, _, out in shapes if out != vocab} == {96, 160}
    assert check_products("learner", 80, shapes, torch.device("cpu"), torch.float32) >= 0.0
    kept = PolicyTrainer(
        tmp_path / "model",
        dataclasses.replace(cpu, logprob_keep_logits=True),
        AlgorithmConfig(),
    )
    assert {rows for rows, _, out in product_shapes(kept) if out == vocab} == {32, 96}


def _wrong_for(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A product that is right except for one of the three the check makes."""

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(a, b)
        # forward: (rows, inner) @ (inner, out); input gradient: (rows, out) @ (out, inner);
        # weight gradient: (out, rows) @ (rows, inner)
        which = {(48, 16): "forward", (48, 24): "input gradient", (24, 48): "weight gradient"}
        return out * 1.5 if which.get((a.shape[0], a.shape[1])) == kind else out

    return mm


@pytest.mark.parametrize("kind", ["forward", "input gradient", "weight gradient"])
def test_a_wrong_product_refuses_the_share_naming_it(kind: str) -> None:
    """The forward's product or either of the backward's, off by half its value: refused,
    with the layer and the token count; the right products pass."""
    shapes = [(48, 16, 24)]
    check_products("critic", 70, shapes, torch.device("cpu"), torch.float32)
    with pytest.raises(
        SmShareRefused,
        match=rf"critic\.gpu_share = 70: the {kind} product of a layer 16 -> 24 at 48 tokens",
    ):
        check_products("critic", 70, shapes, torch.device("cpu"), torch.float32, _wrong_for(kind))


def test_non_finite_products_refuse_the_share() -> None:
    def nan_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b) * float("nan")

    with pytest.raises(SmShareRefused, match="is off by up to inf"):
        check_products("learner", 80, [(8, 4, 4)], torch.device("cpu"), torch.float32, nan_mm)
