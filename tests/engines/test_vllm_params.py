"""The vLLM engine's weight parameters, checked without vllm: the learner's update of the same
checkpoint passes the receiver's validation against them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.engines.vllm_engine import checkpoint_params
from pipeline.errors import MetadataRejected
from pipeline.models import ModelConfig, load_model, save_model
from pipeline.weights.plan import BucketPlan, TensorSpec
from pipeline.weights.validate import validate_meta
from pipeline.wire.messages import WeightMeta

from .helpers import TINY, make_model

TIED_QWEN2 = TINY.replace(model_type="qwen2", tie_word_embeddings=True, attention_bias=True)


def _saved(config: ModelConfig, path: Path) -> Path:
    save_model(make_model(config), path)
    return path


def _learner_meta(path: Path, dtype: torch.dtype) -> WeightMeta:
    """WeightMeta as the learner's publisher plans it: its model's named_parameters."""
    model = load_model(path)
    specs = [TensorSpec(n, tuple(p.shape), dtype) for n, p in model.named_parameters()]
    plan = BucketPlan.build(specs, bucket_bytes=1 << 16)
    return WeightMeta(
        version=1,
        entries=plan.entries(),
        bucket_sizes=list(plan.bucket_sizes),
        transport="gloo",
    )


def _stored_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("config", [TINY, TIED_QWEN2], ids=["llama", "tied-qwen2"])
def test_the_learners_update_validates_against_the_checkpoint_params(config, tmp_path):
    path = _saved(config, tmp_path)
    params = checkpoint_params(path, torch.bfloat16)
    layout = validate_meta(_learner_meta(path, torch.bfloat16), params)
    assert set(layout.full) == set(params)
    assert all(spec.dtype == torch.bfloat16 for spec in params.values())
    # the checkpoint's own names, which vLLM's loaders take in checkpoint format
    assert set(params) == _stored_names(path)
    assert params["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)


def test_a_tied_lm_head_stored_in_the_checkpoint_is_not_expected(tmp_path):
    """HF checkpoints of tied models may store lm_head.weight; the learner never sends it
    (named_parameters yields the shared tensor once, as the embedding)."""
    path = _saved(TIED_QWEN2, tmp_path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    params = checkpoint_params(path)
    assert "lm_head.weight" not in params
    validate_meta(_learner_meta(path, torch.float32), params)


def test_the_serving_dtype_defaults_to_the_checkpoints_and_a_mismatch_is_refused(tmp_path):
    path = _saved(TINY, tmp_path)
    params = checkpoint_params(path)
    assert {spec.dtype for spec in params.values()} == {torch.float32}
    with pytest.raises(MetadataRejected, match="dtype"):
        validate_meta(_learner_meta(path, torch.bfloat16), params)
