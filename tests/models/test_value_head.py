"""Value model: per-token (b, s) values, HF reward-model checkpoint compatibility."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.models import CheckpointError, ModelConfig, ValueModel, load_model, save_model

ATOL = 1e-5
RTOL = 1e-5


def _ids(config: ModelConfig, batch: int = 2) -> torch.Tensor:
    # the last vocab id is reserved as pad_token_id for HF's last-token pooling
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, config.vocab_size - 1, (batch, 7), generator=gen)


def test_value_model_returns_float32_values_per_token_and_hf_names(family_config: ModelConfig):
    model = ValueModel(family_config)
    assert model.score.weight.shape == (1, family_config.hidden_size)
    assert "score.weight" in model.state_dict() and "lm_head.weight" not in model.state_dict()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    values = model(_ids(family_config), attention_mask=mask)
    assert values.shape == (2, 7) and values.dtype == torch.float32


def test_value_model_from_causal_lm_checkpoint_keeps_trunk_and_zero_score(
    family_config: ModelConfig, make_native, tmp_path: Path
):
    lm = make_native(family_config)
    save_model(lm, tmp_path)
    critic = load_model(tmp_path, value_head=True)
    assert isinstance(critic, ValueModel)
    for name, tensor in critic.state_dict().items():
        if name != "score.weight":
            torch.testing.assert_close(tensor, lm.state_dict()[name], atol=0, rtol=0)
    assert torch.count_nonzero(critic.score.weight) == 0
    with torch.no_grad():
        assert torch.count_nonzero(critic(_ids(family_config))) == 0


def test_hf_sequence_classification_checkpoint_loads_and_save_reloads_in_hf(
    family_config: ModelConfig, randomize, tmp_path: Path
):
    import transformers

    hf_dict = {**family_config.to_hf_dict(), "pad_token_id": family_config.vocab_size - 1}
    hf_config = transformers.AutoConfig.for_model(**hf_dict, num_labels=1)
    hf = transformers.AutoModelForSequenceClassification.from_config(hf_config, dtype=torch.float32)
    hf.eval()
    randomize(hf, seed=3)
    hf.save_pretrained(tmp_path / "hf")

    critic = load_model(tmp_path / "hf", value_head=True)
    ids = _ids(family_config)
    with torch.no_grad():
        expected = hf(ids).logits[:, 0]  # HF pools the last (non-pad) token
        values = critic(ids)
    torch.testing.assert_close(values[:, -1], expected, atol=ATOL, rtol=RTOL)

    save_model(critic, tmp_path / "native")
    hf_again = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "native", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_again(ids).logits[:, 0], expected, atol=ATOL, rtol=RTOL)
    with pytest.raises(CheckpointError, match=r"score\.weight"):
        load_model(tmp_path / "native", value_head=False)
