"""save_model output loads in transformers; transformers checkpoints load natively."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.models import CausalLM, CheckpointError, ModelConfig, load_model, save_model

ATOL = 1e-5
RTOL = 1e-5


def _ids(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000], ids=["single_file", "sharded"])
def test_save_model_loads_in_transformers_with_same_logits(
    family_config: ModelConfig, make_native, tmp_path: Path, max_shard_bytes: int | None
):
    import transformers

    model = make_native(family_config)
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_model(model, tmp_path, **kwargs)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if max_shard_bytes is None:
        assert files == ["model.safetensors"]
    else:
        assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    stored = set()
    for f in files:
        stored |= set(load_file(tmp_path / f))
    assert ("lm_head.weight" in stored) != family_config.tie_word_embeddings

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _ids(family_config)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shard", ["single_file", "sharded"])
def test_load_model_of_transformers_checkpoint_round_trips(
    family_config: ModelConfig, make_hf_twin, tmp_path: Path, shard: str
):
    hf, native = make_hf_twin(family_config)
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if shard == "sharded" else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard == "sharded")
    loaded = load_model(tmp_path)
    assert isinstance(loaded, CausalLM)
    assert loaded.config == family_config
    for name, tensor in native.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (
        family_config.tie_word_embeddings
    )
    ids = _ids(family_config)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)
    # and native save of the loaded model reloads to identical tensors
    save_model(loaded, tmp_path / "again")
    again = load_model(tmp_path / "again")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=0, rtol=0)


SMALL = ModelConfig(
    model_type="qwen2",
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=True,
)


def test_load_model_dtype_override_sets_param_and_config_dtype(make_native, tmp_path: Path):
    save_model(make_native(SMALL), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"
    bf16 = load_model(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.config.torch_dtype == "bfloat16"
    save_model(bf16, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_model(tmp_path / "bf16").model.norm.weight.dtype == torch.bfloat16


def test_load_model_refuses_missing_and_unexpected_names_listing_them(make_native, tmp_path: Path):
    save_model(make_native(SMALL), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.0.mlp.extra.weight" in str(err.value)


def test_load_model_refuses_wrong_shape_and_tolerates_tied_lm_head(make_native, tmp_path: Path):
    model = make_native(SMALL)
    save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # HF allows this
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(tmp_path)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .* shape \(3,\)"):
        load_model(tmp_path)


def test_load_model_without_config_or_weights_is_a_checkpoint_error(tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_hf_dict()))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)
