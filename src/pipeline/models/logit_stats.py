"""The log-prob passes over (tokens, vocab) logits as Triton kernels: statistics in one read,
the gradient in one read and one write.

The learner's forward needs, per token, log p(target), the log-sum-exp (kept for backward)
and the entropy. Written as torch ops (`logprobs._logit_stats`) the compiled kernel reads
each row twice (its maximum, then the exponentials); with a 152k vocabulary that is 1.9 GB
per read for 6k tokens. Here one program streams one row once with an online softmax: a
running maximum m, and per lane the running sums of exp(z - m) and exp(z - m) * z, both
rescaled by exp(m_old - m_new) when the maximum grows and summed across lanes only at the
end (one block-wide reduction per step, the maximum, instead of three), so lse = m + log s
and the entropy H = lse - t / s; the next block's load is issued before the current one is
reduced. The target's logit is one extra load.

The backward's d(loss)/d(logits) (`logprobs._logit_grad`) is elementwise given the row's
(lse, entropy, upstream gradients): `logit_grad` runs it on a (row, vocabulary block) grid,
so no program divides a flat index by the vocabulary to find its row.

Numerics: float32 throughout, z = logits / temperature as in the torch versions.
"""

from __future__ import annotations

import torch

from pipeline.models.triton_support import half_kernel_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch version serves
    triton = None

# vocabulary entries per inner step of the statistics kernel, and its warps; the next
# block's load is issued before the current one is reduced (faster: docs/performance.md)
BLOCK = 2048
STATS_WARPS = 4
GRAD_BLOCK = 4096  # vocabulary entries per program of the gradient kernel


def kernels_supported(logits: torch.Tensor) -> bool:
    """Triton present and CUDA half precision with unit stride over the vocabulary (or the
    Triton interpreter, for tests)."""
    return logits.dim() == 2 and logits.stride(-1) == 1 and half_kernel_runs(logits)


def logit_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(target), log-sum-exp, entropy or empty) of (n, vocab) logits, float32 (n,)."""
    n, vocab = logits.shape
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
    if n:
        _stats_kernel[(n,)](
            logits,
            targets.contiguous(),
            logp,
            lse,
            entropy,
            logits.stride(0),
            vocab,
            float(temperature),
            WITH_ENTROPY=with_entropy,
            SCALED=temperature != 1.0,
            BLOCK=BLOCK,
            num_warps=STATS_WARPS,
        )
    return logp, lse, entropy


def logit_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d(loss)/d(logits) of (n, vocab) logits in their dtype: `logprobs._logit_grad`. The
    per-row inputs may be strided (autograd hands a sum's gradient as an expanded scalar):
    the kernel reads them contiguous."""
    n, vocab = logits.shape
    out = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n:
        rows = [t.contiguous() for t in (targets, lse, g_logp, g_ent, entropy)]
        _grad_kernel[(n, triton.cdiv(vocab, GRAD_BLOCK))](
            logits,
            out,
            *rows,
            logits.stride(0),
            vocab,
            float(temperature),
            SCALED=temperature != 1.0,
            BLOCK=GRAD_BLOCK,
            num_warps=8,
        )
    return out


if triton is not None:

    @triton.jit
    def _stats_kernel(
        logits_ptr,
        targets_ptr,
        logp_ptr,
        lse_ptr,
        ent_ptr,
        stride_row,
        vocab,
        temperature,
        WITH_ENTROPY: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)  # per lane, rescaled to the running maximum
        t = tl.zeros((BLOCK,), tl.float32)
        ahead = tl.load(base + offs, mask=offs < vocab, other=float("-inf"))
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            inside = cols < vocab
            z = ahead.to(tl.float32)
            # the next block in flight while this one is reduced
            ahead = tl.load(base + cols + BLOCK, mask=cols + BLOCK < vocab, other=float("-inf"))
            if SCALED:
                z = z / temperature
            new_m = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - new_m)  # 0 on the first block (m = -inf)
            e = tl.exp(z - new_m)  # 0 outside the vocabulary
            s = s * scale + e
            if WITH_ENTROPY:
                t = t * scale + tl.where(inside, e * z, 0.0)
            m = new_m
        total = tl.sum(s, 0)
        lse = m + tl.log(total)
        target = tl.load(targets_ptr + row)
        z_t = tl.load(base + target).to(tl.float32)
        if SCALED:
            z_t = z_t / temperature
        tl.store(logp_ptr + row, z_t - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, lse - tl.sum(t, 0) / total)

    @triton.jit
    def _grad_kernel(
        logits_ptr,
        out_ptr,
        targets_ptr,
        lse_ptr,
        g_logp_ptr,
        g_ent_ptr,
        ent_ptr,
        stride_row,
        vocab,
        temperature,
        SCALED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        z = tl.load(logits_ptr + row * stride_row + cols, mask=inside, other=0.0).to(tl.float32)
        if SCALED:
            z = z / temperature
        g_logp = tl.load(g_logp_ptr + row)
        logq = z - tl.load(lse_ptr + row)
        q = tl.exp(logq)
        grad = -q * (g_logp + tl.load(g_ent_ptr + row) * (logq + tl.load(ent_ptr + row)))
        grad = tl.where(cols == tl.load(targets_ptr + row), grad + g_logp, grad)
        if SCALED:
            grad = grad / temperature
        out = out_ptr + row * vocab + cols
        tl.store(out, grad.to(out_ptr.dtype.element_ty), mask=inside)
