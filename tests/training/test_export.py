"""export_hf writes safetensors that transformers loads with logits equal to the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.models import ModelConfig, load_model
from pipeline.training import PolicyTrainer, TrainerConfig

from ._helpers import TINY, TINY_LLAMA, assert_transformers_runs_it, make_batch, save_tiny_model


@pytest.mark.parametrize("config", [TINY, TINY_LLAMA], ids=["qwen2_tied", "llama_untied"])
def test_exported_trained_policy_loads_in_transformers_with_equal_logits(
    tmp_path: Path, config: ModelConfig
):

    trainer = PolicyTrainer(
        save_tiny_model(tmp_path / "model", config),
        TrainerConfig(device="cpu", lr=1e-2),
        AlgorithmConfig(),
    )
    trainer.train_step(make_batch(seed=0))  # export trained, not initial, weights
    trainer.export_hf(tmp_path / "export")

    assert_transformers_runs_it(tmp_path / "export", trainer.model)
    reloaded = load_model(tmp_path / "export")
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trainer.model.state_dict()[name]), name


def test_export_casts_to_requested_dtype_for_serving(tmp_path: Path):
    trainer = PolicyTrainer(
        save_tiny_model(tmp_path / "model"), TrainerConfig(device="cpu"), AlgorithmConfig()
    )
    trainer.export_hf(tmp_path / "bf16", dtype=torch.bfloat16)
    reloaded = load_model(tmp_path / "bf16")
    assert reloaded.config.torch_dtype == "bfloat16"
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert trainer.model.model.embed_tokens.weight.dtype == torch.float32  # trainer untouched
