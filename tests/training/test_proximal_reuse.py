"""`trainer.reuse_behaviour_logprobs`: an on-policy batch's behaviour log-probs serve as the
proximal ones (no forward for them); every reuse_check_every-th on-policy step measures the
mismatch instead, and a mismatch above the bound stops the reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import PolicyTrainer, TrainerConfig

from ._helpers import make_batch, save_tiny_model, state_of

CONFIG = TrainerConfig(device="cpu", lr=1e-3, max_tokens_per_micro_batch=30, mini_batches=2)
REUSE = CONFIG.replace(reuse_behaviour_logprobs=True, reuse_check_every=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("reuse") / "model")


def _on_policy(trainer: PolicyTrainer, seed: int, shift: float = 0.0):
    """A batch whose behaviour log-probs are the trainer's own (plus `shift`): what the
    current weights, sampling it, would have logged."""
    batch = make_batch(seed)
    own = trainer.compute_logprobs(batch)
    return batch.replace(behaviour_logprobs=torch.where(batch.response_mask, own + shift, 0.0))


def test_reused_steps_train_as_the_proximal_forward_would(model_dir: Path):
    reusing = PolicyTrainer(model_dir, REUSE, AlgorithmConfig())
    plain = PolicyTrainer(model_dir, CONFIG, AlgorithmConfig())
    flags, losses = [], []
    for seed in range(5):
        batch = _on_policy(plain, seed)
        a = reusing.submit_step(batch, on_policy=True).result()
        b = plain.submit_step(batch, on_policy=True).result()
        flags.append(a["actor/proximal_reused"])
        assert b["actor/proximal_reused"] == 0.0 and "mismatch/kl" in b
        assert ("mismatch/kl" in a) == (a["actor/proximal_reused"] == 0.0)
        losses.append((a["actor/pg_loss"], b["actor/pg_loss"]))
    assert flags == [0.0, 1.0, 1.0, 0.0, 1.0]  # a check every third on-policy step
    for a_loss, b_loss in losses:
        assert a_loss == pytest.approx(b_loss, rel=1e-5, abs=1e-7)
    for (name, a), (_, b) in zip(
        state_of(reusing.model).items(), state_of(plain.model).items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_stale_batch_is_never_reused_and_a_mismatch_stops_the_reuse(model_dir: Path):
    trainer = PolicyTrainer(model_dir, REUSE, AlgorithmConfig())
    stale = trainer.submit_step(_on_policy(trainer, 0), on_policy=False).result()
    assert stale["actor/proximal_reused"] == 0.0
    # the engine's log-probs 0.1 off the learner's: KL ~5e-3 at the check
    checked = trainer.submit_step(_on_policy(trainer, 1, shift=0.1), on_policy=True).result()
    assert checked["mismatch/kl"] > REUSE.reuse_max_mismatch_kl
    later = [
        trainer.submit_step(_on_policy(trainer, s, shift=0.1), on_policy=True).result()
        for s in (2, 3)
    ]
    assert [m["actor/proximal_reused"] for m in later] == [0.0, 0.0]
