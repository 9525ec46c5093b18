"""Checkpoint/resume: a run stopped after step 2 and resumed by fresh trainer objects
continues bit-identically to an uninterrupted run (CPU, float32)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import (
    CheckpointStateError,
    CriticTrainer,
    PolicyTrainer,
    TrainerConfig,
    latest_step,
)
from pipeline.training.config import LoraSection

from ._helpers import make_batch, save_tiny_model, state_of

TOTAL = 5
STOP = 2
CONFIG = TrainerConfig(
    device="cpu",
    lr=3e-3,
    schedule="cosine",
    warmup_steps=2,
    total_steps=20,
    ppo_epochs=2,
    mini_batches=2,
    max_tokens_per_micro_batch=20,
    shuffle=True,  # the epoch order must be reproduced from (seed, step, epoch)
)
ALGORITHM = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.05, entropy_coef=0.01)


def _draws() -> tuple[list[float], float, float]:
    """One draw from each global RNG the checkpoint restores."""
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def _steps(trainer: PolicyTrainer, start: int, stop: int) -> list[float]:
    return [trainer.train_step(make_batch(seed=s))["actor/loss"] for s in range(start, stop)]


# flat: bfloat16 compute with the fused AdamW, i.e. the flat-buffer optimizer (flat_adamw.py),
# whose state a load replaces and which must bind it again; also with its first moment in
# bfloat16 (saved and restored as such)
FLAT = CONFIG.replace(param_dtype="bfloat16", fused_optimizer=True)
# LoRA: the checkpoint holds the adapters and their Adam state (the base is rebuilt from the
# model directory); dropout draws from the RNG the checkpoint restores
LORA = CONFIG.replace(lora=LoraSection(rank=4, alpha=8.0, dropout=0.1))


@pytest.mark.parametrize(
    "config",
    [CONFIG, FLAT, FLAT.replace(exp_avg_dtype="bfloat16"), LORA],
    ids=["float32", "flat", "flat-bf16-moment", "lora"],
)
def test_resumed_run_matches_uninterrupted_run_bitwise(tmp_path: Path, config: TrainerConfig):
    model_dir = save_tiny_model(tmp_path / "model")
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)

    full = PolicyTrainer(model_dir, config, ALGORITHM)
    losses = _steps(full, 0, STOP)
    draws = _draws()
    losses += _steps(full, STOP, TOTAL)
    expected_state = state_of(full.model)
    expected_lr = full.engine.lr
    del full

    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    first = PolicyTrainer(model_dir, config, ALGORITHM)
    first_losses = _steps(first, 0, STOP)
    first.save_checkpoint(tmp_path / "ckpt", extra={"cursor": STOP, "in_flight": ["p3", "p4"]})
    del first
    torch.manual_seed(999)  # scramble: the resume must restore the RNG, not inherit it
    np.random.seed(999)
    random.seed(999)

    resumed = PolicyTrainer(model_dir, config, ALGORITHM)
    loaded = resumed.load_checkpoint(tmp_path / "ckpt")
    assert loaded.step == STOP == resumed.step
    assert loaded.extra == {"cursor": STOP, "in_flight": ["p3", "p4"]}
    assert _draws() == draws
    resumed_losses = _steps(resumed, loaded.extra["cursor"], TOTAL)

    assert first_losses + resumed_losses == losses
    assert resumed.engine.lr == expected_lr
    assert resumed.engine.optimizer_steps == config.ppo_epochs * config.mini_batches * TOTAL
    flat = resumed.engine._flat
    assert (flat is not None and not flat.disabled) == (config.param_dtype == "bfloat16")
    if flat is not None:
        assert flat.exp_avg.dtype == getattr(torch, config.exp_avg_dtype)
    for name, value in state_of(resumed.model).items():
        assert torch.equal(value, expected_state[name]), name


def test_latest_pointer_names_newest_step_and_keep_last_prunes_old_steps(tmp_path: Path):
    model_dir = save_tiny_model(tmp_path / "model")
    trainer = CriticTrainer(model_dir, TrainerConfig(device="cpu", lr=1e-3), AlgorithmConfig())
    root = tmp_path / "ckpt"
    assert latest_step(root) is None
    batch, _ = trainer.compute_advantages(make_batch(seed=0, advantages=False))
    for _ in range(3):
        trainer.train_step(batch)
        trainer.save_checkpoint(root, keep_last=2)
    assert latest_step(root) == 3
    assert (root / "latest").read_text().strip() == "step_3"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_3"]
    meta = json.loads((root / "step_3" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1
    assert not list(root.glob(".latest.tmp*")), "the pointer is renamed into place"

    fresh = CriticTrainer(model_dir, TrainerConfig(device="cpu", lr=1e-3), AlgorithmConfig())
    assert fresh.load_checkpoint(root, step=2).step == 2
    assert fresh.step == 2


def test_checkpoint_refuses_non_json_extra_and_missing_checkpoint(tmp_path: Path):
    model_dir = save_tiny_model(tmp_path / "model")
    trainer = PolicyTrainer(model_dir, TrainerConfig(device="cpu"), AlgorithmConfig())
    with pytest.raises(CheckpointStateError, match="JSON"):
        trainer.save_checkpoint(tmp_path / "ckpt", extra={"cursor": object()})
    assert latest_step(tmp_path / "ckpt") is None
    with pytest.raises(CheckpointStateError, match="no checkpoint"):
        trainer.load_checkpoint(tmp_path / "ckpt")


def test_saving_before_the_first_update_does_not_change_later_updates(tmp_path: Path):
    model_dir = save_tiny_model(tmp_path / "model")
    plain = PolicyTrainer(model_dir, TrainerConfig(device="cpu", lr=1e-2), AlgorithmConfig())
    saved = PolicyTrainer(model_dir, TrainerConfig(device="cpu", lr=1e-2), AlgorithmConfig())
    saved.save_checkpoint(tmp_path / "ckpt")  # DCP must not fake-initialise Adam (step 1)
    resumed = PolicyTrainer(model_dir, TrainerConfig(device="cpu", lr=1e-2), AlgorithmConfig())
    resumed.load_checkpoint(tmp_path / "ckpt")
    for trainer in (plain, saved, resumed):
        trainer.train_step(make_batch(seed=0))
    expected = state_of(plain.model)
    for other in (saved, resumed):
        for name, value in state_of(other.model).items():
            assert torch.equal(value, expected[name]), name
