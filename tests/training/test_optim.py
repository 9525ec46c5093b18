"""LR schedules with warmup, and gradient clipping that reports the pre-clip norm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.training import TrainerConfig, build_optimizer, build_scheduler, clip_grad_norm
from pipeline.training.optim import lr_lambda

REPO = Path(__file__).resolve().parents[2]


def test_warmup_then_linear_and_cosine_decay_reach_min_ratio_at_total_steps():
    linear = lr_lambda(
        TrainerConfig(schedule="linear", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    )
    assert [linear(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert linear(9) == pytest.approx(0.55)
    assert linear(14) == pytest.approx(0.1) == linear(100)
    cosine = lr_lambda(TrainerConfig(schedule="cosine", warmup_steps=0, total_steps=10))
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.5) and cosine(10) == pytest.approx(0.0)
    assert lr_lambda(TrainerConfig(schedule="constant"))(10**6) == 1.0


def test_decaying_schedule_without_total_steps_is_a_config_error():
    with pytest.raises(ConfigError, match="total_steps"):
        TrainerConfig(schedule="cosine", total_steps=0).validate()
    with pytest.raises(ConfigError, match=r"unknown config key 'learner\.trainer\.learning_rate'"):
        load_config(REPO / "profiles/local-cpu.toml", {"learner.trainer.learning_rate": "1e-5"})


def test_clip_returns_pre_clip_norm_and_scales_gradients_to_max_norm():
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, TrainerConfig(lr=0.1))
    scheduler = build_scheduler(optimizer, TrainerConfig(lr=0.1, warmup_steps=2))
    assert scheduler.get_last_lr() == [0.05]
    model.weight.grad = torch.full_like(model.weight, 3.0)
    model.bias.grad = torch.full_like(model.bias, 4.0)
    expected = math.sqrt(6 * 9 + 2 * 16)
    norm = clip_grad_norm(model.parameters(), 1.0)
    assert float(norm) == pytest.approx(expected)
    after = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters()))
    assert after == pytest.approx(1.0, rel=1e-5)
    assert float(clip_grad_norm(model.parameters(), None)) == pytest.approx(after)
