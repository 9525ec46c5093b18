"""Tiny random models and references shared by the engine tests."""

from __future__ import annotations

import gc
import math
import types
from collections.abc import Iterable

import torch

from pipeline.engines import GenerationOutput
from pipeline.models import CausalLM, KVCache, ModelConfig

TINY = ModelConfig(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def randomize_(model: torch.nn.Module, seed: int, lm_head_scale: float = 4.0) -> None:
    """O(1) weights (HF's 0.02 init gives near-uniform logits that would hide mismatches);
    a larger lm_head makes next-token distributions peaked, so greedy has clear winners."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                scale = lm_head_scale if name == "lm_head.weight" else 1.0
                p.copy_(scale * noise / math.sqrt(p.shape[-1]))
            else:
                p.copy_(1.0 + 0.1 * noise)


def make_model(config: ModelConfig = TINY, seed: int = 0, lm_head_scale: float = 4.0) -> CausalLM:
    model = CausalLM(config).eval()
    randomize_(model, seed, lm_head_scale)
    return model


def kv_cache_for(config: ModelConfig, num_slots: int, max_seq_len: int) -> KVCache:
    """A CPU cache of the model's layers, key/value heads and dtype."""
    return KVCache(
        config.num_hidden_layers,
        num_slots,
        max_seq_len,
        config.num_key_value_heads,
        config.head_dim,
        config.dtype,
    )


def perturbed_state(model: CausalLM, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """A different policy of the same shape: every tensor moved by relative noise."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: t + scale * t.abs().mean() * torch.randn(t.shape, generator=gen)
        for name, t in model.state_dict().items()
    }


def prompts(n: int, lengths: list[int], seed: int = 1, vocab: int = TINY.vocab_size):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=gen).tolist()
        for i in range(n)
    ]


def greedy_reference(model: CausalLM, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full-sequence forwards (no KV cache): the ground truth."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def full_forward_logprobs(
    model: CausalLM, out: GenerationOutput, temperature: float = 1.0
) -> torch.Tensor:
    """log p(output_ids) recomputed from one dense forward, as the learner does."""
    seq = torch.tensor([out.prompt_ids + out.output_ids])
    with torch.no_grad():
        lp = model.token_logprobs(seq[:, :-1], seq[:, 1:], temperature=temperature)
    return lp[0, len(out.prompt_ids) - 1 :]  # (len(output_ids),)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson chi-square goodness of fit of `counts` (vocab,) to `probs` (vocab,).

    Bins of zero probability are left out (the caller asserts they were never drawn) and
    bins expecting fewer than min_expected draws are pooled, as the chi-square
    approximation needs. Returns (p-value, degrees of freedom); the p-value comes from the
    regularised incomplete gamma function, CDF of chi2(df) = P(df / 2, stat / 2).
    """
    counts = counts.double()
    expected = probs.double() * counts.sum()
    keep = expected > 0
    counts, expected = counts[keep], expected[keep]
    small = expected < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    cdf = torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)
    return float(1.0 - cdf), df


def assert_same_sample(got: GenerationOutput, want: GenerationOutput, atol: float = 1e-5) -> None:
    """Same tokens, versions and finish reason; log-probs equal up to batching round-off
    (padding changes the shapes of the matmuls, hence their summation order)."""
    assert got.output_ids == want.output_ids
    assert got.token_versions == want.token_versions
    assert got.finish_reason == want.finish_reason
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=atol, rtol=0
    )


def assert_generations_match(
    got: list[GenerationOutput], want: list[GenerationOutput], atol: float
) -> None:
    """Two engines' outputs for the same requests: the same tokens per (request, sample),
    log-probs within atol."""
    key = lambda o: (o.request_id, o.sample_index)  # noqa: E731
    for g, w in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        assert key(g) == key(w) and g.output_ids == w.output_ids, key(g)
        worst = max((abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)), default=0)
        assert worst < atol, (key(g), worst)


def tensor_bytes_held(obj: object, *, besides: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensor storages reachable from `obj` (through containers, attributes and
    futures, not through modules or code) that none of `besides` shares."""
    skip = {t.untyped_storage().data_ptr() for t in besides}
    opaque = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module)
    seen: set[int] = set()
    held: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, opaque):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in skip:
                held[storage.data_ptr()] = storage.nbytes()
            continue
        stack.extend(gc.get_referents(item))
    return sum(held.values())
