"""The sampler reduces each vocabulary row in chunks (engines/sampling.py): the tokens are
exactly those of a whole-row argmax, ties and masked chunks included, and the log-probs
those of log_softmax."""

from __future__ import annotations

import torch

from pipeline.engines.rng import GumbelNoise
from pipeline.engines.sampling import RowParams, row_argmax, row_chunks, row_logsumexp, sample

VOCAB = 16384  # 8 chunks of 2048


def test_rows_split_into_even_chunks_of_at_least_2048():
    assert row_chunks(151936) == 64  # Qwen2's vocabulary: 64 chunks of 2374
    assert row_chunks(VOCAB) == 8
    assert row_chunks(4095) == 1 and row_chunks(16) == 1


def test_chunked_argmax_is_the_first_maximum_of_the_row():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (64, VOCAB), generator=g).float()  # many ties per row
    x[:, 5000] = 9.0  # one row maximum in chunk 2 ...
    x[:32, 14000] = 9.0  # ... tied on half the rows by one in chunk 6: the first wins
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert set(row_argmax(x).tolist()) == {5000}


def test_chunked_logsumexp_matches_with_masked_chunks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, VOCAB, generator=g) * 4
    x[:, :4096] = float("-inf")  # two whole chunks masked
    torch.testing.assert_close(row_logsumexp(x), x.logsumexp(dim=-1), rtol=0, atol=1e-5)


def test_sample_draws_the_tokens_of_the_whole_row_formula():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, VOCAB, generator=g).to(torch.bfloat16)
    temperature = torch.tensor([0.0, 1.0, 0.7] * 4)  # greedy rows among sampled ones
    params = RowParams(
        temperature=temperature,
        top_p=torch.ones(12),
        top_k=torch.zeros(12, dtype=torch.int64),
        keys=torch.arange(12, dtype=torch.int32) * 7919,
        token_index=torch.arange(12),
    )
    noise = GumbelNoise(VOCAB, "cpu")
    tokens, logprobs = sample(logits, params, noise, truncate=False)
    # the formula of the sampler before chunking: noise on every row, greedy by argmax
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    scaled = logits.float() / t[:, None]
    drawn = (scaled + noise(params.keys, params.token_index)).argmax(dim=-1)
    expected = torch.where(temperature <= 0, logits.float().argmax(dim=-1), drawn)
    assert torch.equal(tokens, expected)
    want = scaled.log_softmax(dim=-1).gather(1, expected[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-5)
    truncated, _ = sample(logits, params, noise, truncate=True)  # top-k/p off: same draw
    assert torch.equal(truncated, expected)
