"""optimizer_paths on CPU: both gradient paths of the flat AdamW run on a trainer's own
parameters and agree on the norm (on CPU the in-place path falls back to the float32 copy;
on CUDA it reads the bf16 gradients through the address table)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.optimizer_paths import optimizer_paths

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import PolicyTrainer, TrainerConfig

from ._helpers import make_batch, save_tiny_model


def test_both_paths_run_on_the_trainers_flat_optimizer(tmp_path: Path) -> None:
    config = TrainerConfig(device="cpu", param_dtype="bfloat16", fused_optimizer=True)
    trainer = PolicyTrainer(save_tiny_model(tmp_path / "model"), config, AlgorithmConfig())
    trainer.train_step(make_batch(seed=1))  # the moments exist
    engine = trainer.engine
    assert engine._flat is not None
    out = optimizer_paths(engine, engine.info.device, repeats=2)
    assert out["float32_ms"] > 0 and out["in_place_ms"] > 0
    assert out["in_place_used"] is False  # no Triton on CPU
    assert out["norms"]["in_place"] == pytest.approx(out["norms"]["float32"], rel=1e-6)
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.train_step(make_batch(seed=2))  # the trainer still steps afterwards


def test_nothing_to_time_without_the_flat_optimizer(tmp_path: Path) -> None:
    trainer = PolicyTrainer(
        save_tiny_model(tmp_path / "model"), TrainerConfig(device="cpu"), AlgorithmConfig()
    )
    assert optimizer_paths(trainer.engine, trainer.engine.info.device) == {}
