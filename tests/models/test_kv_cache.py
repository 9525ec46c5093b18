"""forward_cached (batched right-padded prefill, then decode) equals full-sequence forward."""

from __future__ import annotations

import pytest
import torch

from pipeline.models import CacheCapacityError, KVCache, ModelConfig
from tests.engines.helpers import kv_cache_for

ATOL = 1e-5
RTOL = 1e-5


def _full_logits(model, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(seq[None])[0]  # (len, vocab)


def test_prefill_then_decode_matches_full_forward_per_slot(family_config: ModelConfig, make_native):
    model = make_native(family_config)
    gen = torch.Generator().manual_seed(3)
    vocab = family_config.vocab_size
    lengths = [5, 2, 7]
    slots = torch.tensor([3, 0, 2])  # not contiguous, not in order
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    cache = kv_cache_for(family_config, num_slots=4, max_seq_len=24)
    # Stale garbage everywhere: correct masking must never read beyond each slot's position.
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)

    t = max(lengths)
    ids = torch.zeros(3, t, dtype=torch.long)
    positions = torch.full((3, t), -1)  # -1 = right padding (written to the sink, never read)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
        positions[row, : len(prompt)] = torch.arange(len(prompt))
    logits = model.forward_cached(ids, positions, slots, cache)
    assert logits.shape == (3, t, vocab)
    assert torch.isfinite(logits).all()
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        torch.testing.assert_close(
            logits[row, :n], _full_logits(model, prompt), atol=ATOL, rtol=RTOL
        )

    seqs = list(prompts)
    lens = torch.tensor(lengths)
    for step in range(4):
        new = torch.randint(0, vocab, (3, 1), generator=gen)
        pos = (lens + step)[:, None]  # (b, 1): each slot at its own position
        step_logits = model.forward_cached(new, pos, slots, cache)  # (3, 1, vocab)
        for row in range(3):
            seqs[row] = torch.cat([seqs[row], new[row]])
            expected = _full_logits(model, seqs[row])[-1]
            torch.testing.assert_close(step_logits[row, 0], expected, atol=ATOL, rtol=RTOL)


def test_prefill_logits_at_last_prompt_token_and_chunked_prefill(make_native):
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        qk_norm=True,
    )
    model = make_native(config)
    gen = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 61, (9,), generator=gen)
    full = _full_logits(model, seq)
    cache = kv_cache_for(config, num_slots=2, max_seq_len=16)
    slots = torch.tensor([1])
    # First chunk of 4 tokens, asking only for the last token's logits ...
    last = model.forward_cached(
        seq[None, :4], torch.arange(4)[None], slots, cache, logits_at=torch.tensor([3])
    )
    assert last.shape == (1, 61)
    torch.testing.assert_close(last[0], full[3], atol=ATOL, rtol=RTOL)
    # ... then the remaining 5 as a second prefill chunk that attends to the cached first 4.
    rest = model.forward_cached(seq[None, 4:], torch.arange(4, 9)[None], slots, cache, kv_len=9)
    torch.testing.assert_close(rest[0], full[4:], atol=ATOL, rtol=RTOL)


def test_kv_cache_shape_sink_column_and_capacity_error(make_native):
    cache = KVCache(
        num_layers=2,
        num_slots=3,
        max_seq_len=8,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
    )
    assert cache.k.shape == (2, 3, 9, 2, 4)  # max_seq_len + 1: the last column is the sink
    assert cache.write_index(torch.tensor([[0, 5, -1]])).tolist() == [[0, 5, 8]]
    with pytest.raises(CacheCapacityError, match="max_seq_len=8"):
        cache.kv_len_for(torch.tensor([[8]]))
