"""Padding-free packed forward (block-diagonal causal mask) equals per-sequence forward."""

from __future__ import annotations

import torch

from pipeline.models import ModelConfig, ValueModel

ATOL = 1e-5
RTOL = 1e-5


def _pack(lengths: list[int], vocab: int, tail_pad: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    pad = torch.zeros(tail_pad, dtype=torch.long)
    ids = torch.cat([*seqs, pad])[None]  # (1, total)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(tail_pad)])[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return seqs, ids, positions, cu_seqlens


def test_packed_logits_equal_each_sequence_alone(family_config: ModelConfig, make_native):
    model = make_native(family_config)
    lengths = [4, 6, 3]
    seqs, ids, positions, cu = _pack(lengths, family_config.vocab_size, tail_pad=2, seed=6)
    with torch.no_grad():
        packed = model.forward_packed(ids, positions, cu)  # (1, 15, vocab)
        hidden = model.hidden_states_packed(ids, positions, cu)
    assert packed.shape == (1, 15, family_config.vocab_size)
    assert hidden.shape == (1, 15, family_config.hidden_size)
    assert torch.isfinite(packed).all()
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            alone = model(seq[None])[0]
        torch.testing.assert_close(packed[0, cu[i] : cu[i + 1]], alone, atol=ATOL, rtol=RTOL)


def test_packed_token_logprobs_equal_dense_token_logprobs(make_native):
    config = ModelConfig(
        model_type="llama",
        vocab_size=53,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = make_native(config)
    seqs, ids, positions, cu = _pack([5, 3], 53, tail_pad=0, seed=7)
    targets = torch.roll(ids, -1, dims=1)
    packed = model.token_logprobs(ids, targets, position_ids=positions, cu_seqlens=cu)
    for i, seq in enumerate(seqs):
        dense = model.token_logprobs(seq[None], targets[:, cu[i] : cu[i + 1]])
        torch.testing.assert_close(packed[0, cu[i] : cu[i + 1]], dense[0], atol=ATOL, rtol=RTOL)


def test_value_model_packed_values_equal_dense_values(family_config: ModelConfig):
    torch.manual_seed(0)
    model = ValueModel(family_config).eval()
    model.init_weights(std=0.2)
    torch.nn.init.normal_(model.score.weight)
    seqs, ids, positions, cu = _pack([3, 5], family_config.vocab_size, tail_pad=1, seed=8)
    with torch.no_grad():
        packed = model.forward_packed(ids, positions, cu)
        assert packed.shape == (1, 9)
        for i, seq in enumerate(seqs):
            dense = model(seq[None])[0]
            torch.testing.assert_close(packed[0, cu[i] : cu[i + 1]], dense, atol=ATOL, rtol=RTOL)


def test_uniform_rows_equal_each_sequence_alone(family_config: ModelConfig, make_native):
    """Sequences of one length, packed and vouched `uniform`, attend as a (rows, length)
    batch: the same logits as each sequence alone, for every family (q/k norms, biases)."""
    from pipeline.models.attention import cudnn_rows_supported

    assert not cudnn_rows_supported(torch.device("cpu"), torch.bfloat16)  # SDPA serves CPU
    model = make_native(family_config)
    model.uniform_attention = True
    seqs, ids, positions, cu = _pack([5, 5, 5], family_config.vocab_size, tail_pad=0, seed=9)
    with torch.no_grad():
        rows = model.forward_packed(ids, positions, cu, max_seqlen=5, uniform=True)
        values = ValueModel(family_config).eval()
        values.uniform_attention = True
        packed_values = values.forward_packed(ids, positions, cu, max_seqlen=5, uniform=True)
        mask_values = values.forward_packed(ids, positions, cu)
    torch.testing.assert_close(packed_values, mask_values, atol=ATOL, rtol=RTOL)
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            alone = model(seq[None])[0]
        torch.testing.assert_close(rows[0, cu[i] : cu[i + 1]], alone, atol=ATOL, rtol=RTOL)
