"""The transformers path (models/hf_causal.py): which modeling a checkpoint gets and why,
the wrappers' entry points against transformers' own forward, and the export's logits."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.models import CausalLM
from pipeline.models.hf_causal import (
    HFCausalLM,
    HFValueModel,
    choose_implementation,
    load_for_training,
    rollout_choice,
)
from tests.hf_families import make_family


def _write_config(directory, **raw):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_native_families_stay_native_and_others_go_to_transformers(tmp_path):
    mistral = make_family("mistral", tmp_path / "mistral")
    assert choose_implementation(mistral).implementation == "native"
    assert isinstance(load_for_training(mistral), CausalLM)
    gemma = make_family("gemma2", tmp_path / "gemma2")
    choice = choose_implementation(gemma)
    assert choice.implementation == "transformers" and "gemma2" in choice.reason
    forced = choose_implementation(mistral, "transformers")
    assert forced.implementation == "transformers" and "asked for" in forced.reason
    with pytest.raises(ConfigError, match="native decoder cannot run"):
        choose_implementation(gemma, "native")


def test_a_mistral_without_a_binding_window_is_the_native_llama_decoder(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.models import load_model, save_model

    directory = make_family("mistral", tmp_path / "mistral")
    native = load_model(directory, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(3, theirs.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(native(ids), theirs(ids).logits, atol=1e-5, rtol=0)
    save_model(native, tmp_path / "saved")  # still a Mistral checkpoint for transformers
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "mistral" and saved["architectures"] == ["MistralForCausalLM"]


def test_a_mistral_window_that_binds_takes_transformers(tmp_path):
    directory = make_family("mistral", tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    raw["sliding_window"] = 16  # < max_position_embeddings 256
    (directory / "config.json").write_text(json.dumps(raw))
    choice = choose_implementation(directory)
    assert choice.implementation == "transformers" and "sliding_window=16" in choice.reason


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
        ({"model_type": "gemma3", "vision_config": {}}, "multimodal"),
        ({"model_type": "distilbert"}, "no causal-LM head"),
    ],
)
def test_what_nothing_can_train_is_refused_with_the_reason(tmp_path, raw, match):
    with pytest.raises(ConfigError, match=match):
        choose_implementation(_write_config(tmp_path / "m", **raw))


def test_the_torch_engine_is_refused_for_a_transformers_model(tmp_path):
    gemma = make_family("gemma2", tmp_path / "gemma2")
    with pytest.raises(ConfigError, match=r"rollout\.engine = 'hf'"):
        rollout_choice(gemma, "torch")
    assert rollout_choice(gemma, "hf").implementation == "transformers"


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_entry_points_match_transformers_forward(tmp_path, family):
    from transformers import AutoModelForCausalLM

    directory = make_family(family, tmp_path / family)
    model = load_for_training(directory)
    assert isinstance(model, HFCausalLM)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert dict(model.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    torch.manual_seed(1)
    lengths = [5, 11, 13]  # longer than gemma2's window of 8
    ids = torch.randint(3, model.config.vocab_size, (1, sum(lengths)))
    targets = torch.randint(3, model.config.vocab_size, (1, sum(lengths)))
    cu = torch.tensor([0, 5, 16, 29])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed, entropy = model.token_logprobs(
            ids, targets, position_ids=positions, cu_seqlens=cu, return_entropy=True
        )
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            logits = reference(ids[:, start:end]).logits.double()  # (1, n, vocab)
            logp = torch.log_softmax(logits, -1)
            expect = logp.gather(-1, targets[:, start:end, None]).squeeze(-1)
            torch.testing.assert_close(packed[:, start:end].double(), expect, atol=1e-5, rtol=0)
            ent = -(logp.exp() * logp).sum(-1)
            torch.testing.assert_close(entropy[:, start:end].double(), ent, atol=1e-5, rtol=0)
        index = torch.tensor([3, 7, 20])
        picked = model.token_logprobs(
            ids, targets, position_ids=positions, cu_seqlens=cu, score_index=index
        )
        torch.testing.assert_close(picked, packed[0, index])


def test_the_value_head_starts_at_zero_on_the_transformers_trunk(tmp_path):
    directory = make_family("olmo2", tmp_path / "olmo2")
    critic = load_for_training(directory, value_head=True, role="critic")
    assert isinstance(critic, HFValueModel)
    names = {name for name, _ in critic.named_parameters()}
    assert "score.weight" in names and "model.embed_tokens.weight" in names
    ids = torch.randint(3, critic.config.vocab_size, (2, 6))
    values = critic(ids)
    assert values.shape == (2, 6) and not values.any()
    values.sum().backward()  # the head's gradient flows from the trunk's hidden states
    assert critic.score.weight.grad is not None and critic.score.weight.grad.abs().sum() > 0


def test_the_export_loads_in_transformers_with_the_learners_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.training.export import export_hf

    directory = make_family("gemma3_text", tmp_path / "gemma3")
    model = load_for_training(directory)
    torch.manual_seed(2)
    with torch.no_grad():  # a trained model: not the checkpoint's weights
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    export_hf(model, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(ids).logits, model(ids), atol=1e-5, rtol=0)
