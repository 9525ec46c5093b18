"""The engine samples from softmax(logits / T), truncated by top-k / top-p and renormalised.

Each case draws 4000 first tokens of one prompt (one request, n = 4000, batched over 500
slots) and runs a Pearson chi-square goodness-of-fit test against the distribution computed
independently in float64 from a dense forward. Significance level: 0.001 (reject when the
p-value is below it). Draws are seeded, so each case is deterministic, not flaky; a power
check shows that the same test rejects a wrong temperature.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engines import GenerationRequest, SamplingParams, TorchEngine, TorchEngineConfig
from pipeline.engines.sampling import truncate_top_k_top_p

from .helpers import TINY, chi_square_pvalue, make_model

ALPHA = 1e-3
DRAWS = 4000
PROMPT = [3, 1, 4, 1, 5, 9]
SMALL = TINY.replace(vocab_size=16)


@pytest.fixture(scope="module")
def small_model():
    return make_model(SMALL, seed=3, lm_head_scale=1.5)


@pytest.fixture(scope="module")
def next_token_logits(small_model) -> torch.Tensor:
    with torch.no_grad():
        return small_model(torch.tensor([PROMPT]))[0, -1].double()  # (vocab,)


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Reference truncation written independently of the engine: explicit loop in float64."""
    probs = (logits / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept: list[int] = []
    for rank, token in enumerate(order):
        if top_k and rank >= top_k:
            break
        kept.append(token)
    mass = probs[kept] / probs[kept].sum()  # renormalised top-k
    nucleus: list[int] = []
    total = 0.0
    for token, p in zip(kept, mass.tolist(), strict=True):
        if top_p < 1.0 and total >= top_p:
            break
        nucleus.append(token)
        total += p
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return out


def _first_token_counts(model, params: SamplingParams) -> torch.Tensor:
    engine = TorchEngine(model, TorchEngineConfig(max_batch=500, max_seq_len=16, seed=11))
    outs = engine.generate([GenerationRequest("r", PROMPT, params)])
    assert len(outs) == DRAWS
    first = torch.tensor([out.output_ids[0] for out in outs])
    return torch.bincount(first, minlength=SMALL.vocab_size)  # (vocab,)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 0, 1.0), (1.0, 0, 0.8), (1.0, 4, 1.0), (1.3, 6, 0.9)],
    ids=["temperature_0.7", "top_p_0.8", "top_k_4", "top_k_6_top_p_0.9_at_T1.3"],
)
def test_first_token_frequencies_pass_chi_square_against_truncated_softmax(
    small_model, next_token_logits, temperature, top_k, top_p
):
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, n=DRAWS
    )
    counts = _first_token_counts(small_model, params)
    expected = _expected(next_token_logits, temperature, top_k, top_p)
    assert (expected > 0).sum() >= 4  # the case is not degenerate
    assert counts[expected == 0].sum() == 0, "a truncated token was sampled"
    pvalue, df = chi_square_pvalue(counts, expected)
    assert pvalue > ALPHA, f"chi-square p={pvalue:.2e} (df={df}) rejects the sampler"


def test_chi_square_rejects_a_wrong_temperature(small_model, next_token_logits):
    counts = _first_token_counts(
        small_model, SamplingParams(temperature=0.7, max_new_tokens=1, n=DRAWS)
    )
    pvalue, _ = chi_square_pvalue(counts, _expected(next_token_logits, 1.0, 0, 1.0))
    assert pvalue < 1e-6


def test_truncation_keeps_the_nucleus_and_top_k_of_each_row_independently():
    scaled = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    out = truncate_top_k_top_p(scaled, top_k=torch.tensor([0, 2]), top_p=torch.tensor([0.8, 1.0]))
    # row 0: mass before the 3rd token is 0.8 >= 0.8, so the nucleus is {0, 1}
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    # row 1: top-2 only
    assert torch.isfinite(out[1]).tolist() == [False, False, True, True]
    torch.testing.assert_close(out[torch.isfinite(out)], scaled[torch.isfinite(out)])


def test_top_p_one_and_top_k_zero_keep_the_whole_vocabulary():
    scaled = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 10
    out = truncate_top_k_top_p(scaled, torch.zeros(3, dtype=torch.long), torch.ones(3))
    torch.testing.assert_close(out, scaled)
