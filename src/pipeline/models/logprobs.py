"""Token log-probs (and entropy) without materialising (tokens, vocab) logits at once.

With a 150k vocabulary, full logits for a 32k-token micro-batch are ~20 GB in float32. Each
chunk's logits are computed under torch.utils.checkpoint, so the forward keeps only the
(chunk,) results and the backward recomputes one chunk's logits at a time: peak memory is
O(chunk_tokens * vocab) in both passes.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from pipeline.errors import ConfigError


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.t()).float()  # (chunk, vocab)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (chunk,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # (chunk,)
    if not with_entropy:
        return logp, logp.new_zeros(())
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)  # (chunk,)
    return logp, entropy


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(target) in float32, shaped like target_ids; with entropy if asked.

    hidden (..., hidden_size) are final normed hidden states, lm_head_weight (vocab,
    hidden_size), target_ids (...) the token whose probability each position predicts.
    Dividing by `temperature` matches the sampler so that PPO ratios use the same
    distribution the rollouts were drawn from.
    """
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and target_ids {tuple(target_ids.shape)} disagree "
            "on the token dimensions"
        )
    out_shape = target_ids.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (tokens, hidden)
    flat_t = target_ids.reshape(-1)  # (tokens,)
    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start in range(0, flat_t.numel(), chunk_tokens):
        h = flat_h[start : start + chunk_tokens]
        t = flat_t[start : start + chunk_tokens]
        if use_ckpt:
            logp, ent = checkpoint(
                _chunk_logprobs,
                h,
                lm_head_weight,
                t,
                temperature,
                return_entropy,
                use_reentrant=False,
            )
        else:
            logp, ent = _chunk_logprobs(h, lm_head_weight, t, temperature, return_entropy)
        logps.append(logp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(out_shape, dtype=torch.float32)
        return (empty, empty.clone()) if return_entropy else empty
    logp_all = torch.cat(logps).view(out_shape)
    if return_entropy:
        return logp_all, torch.cat(ents).view(out_shape)
    return logp_all
