"""Vectorised per-row sampling: temperature, top-k, top-p, greedy, behaviour log-probs.

Every row carries its own parameters as tensors, so one call serves a batch that mixes greedy
and sampled requests with no Python loop over rows. Truncation follows transformers and vLLM:
temperature first, then top-k, then top-p on the renormalised top-k distribution (the
smallest set of most likely tokens whose mass reaches top_p; the most likely token is always
kept). Sampling is Gumbel-max on the truncated logits, which draws exactly from their softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engines.rng import GumbelNoise


@dataclass
class RowParams:
    """Per-row sampling parameters, each (b,)."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_p: torch.Tensor  # float32, 1 = off
    top_k: torch.Tensor  # int64, 0 = off
    keys: torch.Tensor  # int32 per-sample noise keys
    token_index: torch.Tensor  # int64 index of the token being sampled within its sample


def truncate_top_k_top_p(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """scaled logits (b, vocab) with tokens outside each row's top-k / nucleus set to -inf."""
    vocab = scaled.shape[-1]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # (b, vocab)
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)  # (b,)
    remove = ranks[None, :] >= k[:, None]  # (b, vocab), in sorted order
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (b, vocab) exclusive cumulative mass
    # rows with top_p == 1 skip the test: round-off could otherwise drop the far tail
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove_by_id = torch.empty_like(remove).scatter_(1, sorted_idx, remove)
    return scaled.masked_fill(remove_by_id, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: RowParams,
    noise: GumbelNoise,
    *,
    truncate: bool,
    all_greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled tokens (b,) int64 and their behaviour log-probs (b,) float32.

    The log-prob is taken under log_softmax(logits / temperature), the full distribution
    before truncation (what the learner recomputes); greedy rows use temperature 1.
    truncate=False skips the vocabulary sort when no row uses top-k / top-p, and
    all_greedy=True skips the noise; the caller knows both from the host-side request
    parameters, so deciding needs no device sync.
    """
    logits = logits.float()  # (b, vocab)
    greedy = params.temperature <= 0.0  # (b,)
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / temperature[:, None]  # (b, vocab)
    logprobs = scaled.log_softmax(dim=-1)  # (b, vocab)
    if all_greedy:
        tokens = logits.argmax(dim=-1)  # (b,)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
    candidates = truncate_top_k_top_p(scaled, params.top_k, params.top_p) if truncate else scaled
    drawn = (candidates + noise(params.keys, params.token_index)).argmax(dim=-1)  # (b,)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)  # (b,)
    token_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)  # (b,)
    return tokens, token_logprobs
