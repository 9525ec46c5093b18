"""Token log-probs (and entropy) of the output layer without materialising all the logits.

With a 150k vocabulary, full logits for an 8k-token micro-batch are ~5 GB in float32. A
fused linear + log-softmax autograd function walks the tokens in chunks:

  forward   per chunk: logits = hidden @ W^T (compute dtype), then one pass over them for
            log-sum-exp, the target's log-prob and (optionally) the entropy, in float32;
            only the per-token (lse, entropy) are kept for backward;
  backward  per chunk: the logits are recomputed and turned into d(loss)/d(logits) in one
            pass, then two matmuls give d(hidden) and d(W) (accumulated in float32).

Where memory allows (`keep_logits`), the forward computes all logits in one GEMM and keeps
them (compute dtype) for the backward, which then runs one elementwise pass and two GEMMs
over all tokens: no recompute. Otherwise no (tokens, vocab) tensor outlives its chunk.
Either way nothing like autograd's gather/softmax backward over the whole vocabulary runs.
On CUDA both passes are Triton kernels (models/logit_stats.py: the statistics in one read,
the gradient on a (row, vocabulary block) grid), each falling back to its torch version
compiled by torch.compile, then eager, if it fails; on CPU the torch versions run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.models.logit_stats import kernels_supported, logit_grad, logit_stats
from pipeline.models.tied_embedding import TiedGrad


def _logit_stats(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(target), log-sum-exp, entropy or empty) of (chunk, vocab) logits, float32.

    Two passes over the logits whatever is asked: the row max, then sum(e) and sum(e * z)
    together (e = exp(z - max)), so H = lse - sum(e * z) / sum(e) needs no third pass.
    """
    z = logits.float() / temperature
    top = z.amax(dim=-1, keepdim=True)  # (chunk, 1)
    e = torch.exp(z - top)
    total = e.sum(-1)  # (chunk,)
    lse = top.squeeze(-1) + torch.log(total)  # (chunk,)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse  # (chunk,)
    if not with_entropy:
        return logp, lse, lse.new_zeros(0)
    entropy = lse - (e * z).sum(-1) / total  # (chunk,)
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
    """The elementwise passes: the Triton kernels (models.logit_stats) where they run, else
    their torch versions, compiled once per process on CUDA."""

    def __init__(self) -> None:
        self._compiled: dict[str, Callable[..., Any]] | None = None
        self._failed = False
        self._triton_failed = False

    def get(self, name: str, device: torch.device) -> Callable[..., Any]:
        torch_pass = self._torch_pass(name, device)
        kernel = cast(Callable[..., Any], {"stats": logit_stats, "grad": logit_grad}[name])

        def run(logits: Tensor, *args: Any) -> Any:
            if self._triton_failed or not kernels_supported(logits):
                return torch_pass(logits, *args)
            try:
                return kernel(logits, *args)
            except Exception as exc:
                self._triton_failed = True
                _warn_fallback("the Triton log-prob kernels", exc)
                return torch_pass(logits, *args)

        return run

    def _torch_pass(self, name: str, device: torch.device) -> Callable[..., Any]:
        eager = cast(Callable[..., Any], {"stats": _logit_stats, "grad": _logit_grad}[name])
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
                _warn_fallback("torch.compile of the log-prob kernels", exc)
                return eager(*args)

        return call


def _warn_fallback(what: str, exc: Exception) -> None:
    get_logger("models.logprobs").warning(
        f"{what} failed; running the eager torch version",
        error=f"{type(exc).__name__}: {exc}",
    )


_KERNELS = _Kernels()


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk: int,
        temperature: float,
        with_entropy: bool,
        keep_logits: bool,
        tied: TiedGrad | None,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        stats = _KERNELS.get("stats", hidden.device)
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        # kept only when a backward will read them (never under no_grad)
        keep = keep_logits and any(ctx.needs_input_grad[:2])
        kept = hidden @ weight.t() if keep else None  # (n, vocab): one GEMM, no recompute
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = kept[s:e] if kept is not None else hidden[s:e] @ weight.t()
            lp, ls, ent = stats(logits, targets[s:e], temperature, with_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if with_entropy:
                entropy[s:e] = ent
        ctx.set_materialize_grads(False)  # an output nobody differentiates gets None
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, kept)
        ctx.chunk, ctx.temperature, ctx.tied = chunk, temperature, tied
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse, entropy, kept = ctx.saved_tensors
        n = hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_fn = _KERNELS.get("grad", hidden.device)
        if g_logp is None:
            g_logp = lse.new_zeros(n)
        differentiate_entropy = g_ent is not None and entropy.numel() == n

        def logit_grad(s: int, e: int, logits: Tensor) -> Tensor:
            ge = g_ent[s:e] if differentiate_entropy else lse.new_zeros(e - s)  # type: ignore[index]
            ent = entropy[s:e] if differentiate_entropy else ge
            return grad_fn(logits, targets[s:e], lse[s:e], g_logp[s:e], ge, ent, ctx.temperature)

        if kept is not None:  # d(logits) of all tokens at once, then one GEMM per input
            g = logit_grad(0, n, kept)  # (n, vocab)
            grad_h = g @ weight if want_h else None
            grad_w = g.t() @ hidden if want_w else None  # float32 accumulation inside
            return _grads(ctx, grad_h, grad_w)
        chunk = ctx.chunk
        grad_h = torch.empty_like(hidden) if want_h else None
        acc_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            g = logit_grad(s, e, h @ weight.t())
            if grad_h is not None:
                torch.matmul(g, weight, out=grad_h[s:e])
            if want_w:
                acc_w.add_(g.t() @ h)
        grad_w = acc_w.to(weight.dtype) if want_w else None
        return _grads(ctx, grad_h, grad_w)


def _grads(ctx: Any, grad_h: Tensor | None, grad_w: Tensor | None) -> tuple[Any, ...]:
    """The backward's outputs. With a tied embedding's slot, d(W) goes there instead: the
    embedding's backward (after this one) adds its rows into it and hands autograd the sum
    (models/tied_embedding.py)."""
    if ctx.tied is not None and grad_w is not None:
        ctx.tied.grad, grad_w = grad_w, None
    return grad_h, grad_w, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    keep_logits: bool = False,
    tied: TiedGrad | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(target) in float32, shaped like target_ids; with entropy if asked.

    hidden (..., hidden_size) are final normed hidden states, lm_head_weight (vocab,
    hidden_size), target_ids (...) the token whose probability each position predicts.
    Dividing by `temperature` matches the sampler so that PPO ratios use the same
    distribution the rollouts were drawn from. Both outputs are differentiable.
    `keep_logits` trades memory for time: the (tokens, vocab) logits of a forward that will
    be differentiated are computed by one GEMM and kept for backward instead of recomputed
    chunk by chunk (2.5 GB in bfloat16 for 8k tokens of a 152k vocabulary). `tied`: the
    slot of a `tied_embedding` of the same weight in this forward (its gradient rows then
    go into this one's d(W) in place).
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
        flat_h,
        weight,
        flat_t,
        chunk_tokens,
        float(temperature),
        return_entropy,
        keep_logits,
        tied if weight is lm_head_weight else None,  # a cast copy has its own gradient
    )
    if return_entropy:
        return logp.view(out_shape), entropy.view(out_shape)
    return logp.view(out_shape)
