"""Native decoder logits equal transformers' for every family (weights copied by HF name)."""

from __future__ import annotations

import torch

from pipeline.models import ModelConfig

# float32 on CPU: both sides run the same SDPA math, so differences are round-off only.
ATOL = 1e-5
RTOL = 1e-5


def test_state_dict_names_equal_hf_and_logits_match_dense(family_config: ModelConfig, make_hf_twin):
    hf, native = make_hf_twin(family_config)
    assert sorted(native.state_dict()) == sorted(hf.state_dict())
    ids = torch.randint(
        0, family_config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(ids).logits
        got = native(ids)
    assert got.shape == (3, 12, family_config.vocab_size)
    assert expected.abs().max() > 0.5  # logits are O(1), so ATOL is a meaningful bound
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_left_padded_batch_logits_match_hf_and_unpadded_rows(
    family_config: ModelConfig, make_hf_twin
):
    hf, native = make_hf_twin(family_config)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, family_config.vocab_size, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = native(ids, attention_mask=mask)  # positions derived from the mask
        got_explicit = native(ids, position_ids=positions, attention_mask=mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_explicit, got)
    assert torch.isfinite(got).all()  # padded queries must not produce NaN
    for row, start in ((1, 4), (2, 7)):
        with torch.no_grad():
            alone = native(ids[row : row + 1, start:])
        torch.testing.assert_close(got[row, start:], alone[0], atol=ATOL, rtol=RTOL)


def test_hidden_states_times_lm_head_equal_forward_logits(family_config: ModelConfig, make_native):
    model = make_native(family_config)
    ids = torch.randint(0, family_config.vocab_size, (2, 7))
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        logits = model(ids)
    assert hidden.shape == (2, 7, family_config.hidden_size)
    torch.testing.assert_close(model.lm_head(hidden), logits)


def test_lm_head_is_embed_tokens_exactly_when_tied(family_config: ModelConfig, make_native):
    model = make_native(family_config)
    shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert shared == family_config.tie_word_embeddings
