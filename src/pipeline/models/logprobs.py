"""Token log-probs (and entropy) of the output layer without materialising all the logits.

With a 150k vocabulary, full logits for an 8k-token micro-batch are ~5 GB in float32. A
fused linear + log-softmax autograd function walks the tokens in chunks:

  forward   per chunk: logits = hidden @ W^T (compute dtype), then one pass over them for
            log-sum-exp, the target's log-prob and (optionally) the entropy, in float32;
            only the per-token (lse, entropy) are kept for backward;
  backward  per chunk: the logits are recomputed and turned into d(loss)/d(logits) in one
            pass, then two matmuls give d(hidden) and d(W) (accumulated in float32).

No (tokens, vocab) tensor outlives its chunk, and nothing like autograd's gather/softmax
backward over the whole vocabulary runs. On CUDA the two elementwise passes are compiled
with torch.compile into one kernel each (falling back to eager if compilation fails); on
CPU they run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from pipeline.errors import ConfigError
from pipeline.log import get_logger


def _logit_stats(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(target), log-sum-exp, entropy or empty) of (chunk, vocab) logits, float32."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)  # (chunk,)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse  # (chunk,)
    if not with_entropy:
        return logp, lse, lse.new_zeros(0)
    logq = z - lse[:, None]
    entropy = -(torch.exp(logq) * logq).sum(-1)  # (chunk,)
    return logp, lse, entropy


def _logit_grad(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    g_logp: Tensor,
    g_ent: Tensor,
    entropy: Tensor,
    temperature: float,
) -> Tensor:
    """d(loss)/d(logits) for (chunk, vocab) logits, in the logits' dtype.

    With q = softmax(z), z = logits / T: d logp_t / dz = onehot_t - q and d H / dz =
    -q * (log q + H). `g_ent` is all zeros when the entropy is not differentiated.
    """
    z = logits.float() / temperature
    logq = z - lse[:, None]
    q = torch.exp(logq)
    grad = -q * (g_logp[:, None] + g_ent[:, None] * (logq + entropy[:, None]))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.where(vocab[None, :] == targets[:, None], grad + g_logp[:, None], grad)
    return (grad / temperature).to(logits.dtype)


class _Kernels:
    """The elementwise passes, compiled once per process on CUDA."""

    def __init__(self) -> None:
        self._compiled: dict[str, Callable[..., Any]] | None = None
        self._failed = False

    def get(self, name: str, device: torch.device) -> Callable[..., Any]:
        eager = {"stats": _logit_stats, "grad": _logit_grad}[name]
        if device.type != "cuda" or self._failed:
            return eager
        if self._compiled is None:
            self._compiled = {
                # automatic dynamic shapes: only the token count (last chunk) varies; a static
                # vocabulary keeps the reductions' tiling specialised
                "stats": torch.compile(_logit_stats),
                "grad": torch.compile(_logit_grad),
            }
        compiled = self._compiled[name]

        def call(*args: Any) -> Any:
            if self._failed:
                return eager(*args)
            try:
                return compiled(*args)
            except Exception as exc:
                self._failed = True
                get_logger("models.logprobs").warning(
                    "torch.compile of the log-prob kernels failed; running them eagerly",
                    error=f"{type(exc).__name__}: {exc}",
                )
                return eager(*args)

        return call


_KERNELS = _Kernels()


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        stats = _KERNELS.get("stats", hidden.device)
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lp, ls, ent = stats(hidden[s:e] @ weight.t(), targets[s:e], temperature, with_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if with_entropy:
                entropy[s:e] = ent
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.chunk, ctx.temperature = chunk, temperature
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        n, chunk = hidden.shape[0], ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_fn = _KERNELS.get("grad", hidden.device)
        if g_logp is None:
            g_logp = lse.new_zeros(n)
        differentiate_entropy = g_ent is not None and entropy.numel() == n
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            ge = g_ent[s:e] if differentiate_entropy else lse.new_zeros(e - s)  # type: ignore[index]
            ent = entropy[s:e] if differentiate_entropy else ge
            g = grad_fn(
                h @ weight.t(), targets[s:e], lse[s:e], g_logp[s:e], ge, ent, ctx.temperature
            )
            if grad_h is not None:
                grad_h[s:e] = g @ weight
            if want_w:
                grad_w.add_(g.t() @ h)
        return grad_h, grad_w.to(weight.dtype) if want_w else None, None, None, None, None


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
    distribution the rollouts were drawn from. Both outputs are differentiable.
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
    if flat_t.numel() == 0:
        empty = hidden.new_zeros(out_shape, dtype=torch.float32)
        return (empty, empty.clone()) if return_entropy else empty
    weight = (
        lm_head_weight.to(flat_h.dtype) if lm_head_weight.dtype != flat_h.dtype else lm_head_weight
    )
    logp, entropy = _LinearLogprobs.apply(
        flat_h, weight, flat_t, chunk_tokens, float(temperature), return_entropy
    )
    if return_entropy:
        return logp.view(out_shape), entropy.view(out_shape)
    return logp.view(out_shape)
