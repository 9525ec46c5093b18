"""Log-sum-exp, target log-prob and entropy of (tokens, vocab) logits in one read (Triton).

The learner's forward needs, per token, log p(target), the log-sum-exp (kept for backward)
and the entropy. Written as torch ops (`logprobs._logit_stats`) the compiled kernel reads
each row twice (its maximum, then the exponentials); with a 152k vocabulary that is 1.9 GB
per read for 6k tokens. Here one program streams one row once with an online softmax: a
running maximum m, the running sum s of exp(z - m) and the running sum t of exp(z - m) * z,
both rescaled by exp(m_old - m_new) when the maximum grows, so lse = m + log s and the
entropy H = lse - t / s. The target's logit is one extra load.

Numerics: float32 throughout, z = logits / temperature as in the torch version.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch version serves
    triton = None  # type: ignore[assignment]

BLOCK = 4096  # vocabulary entries per inner step


def stats_kernel_supported(logits: torch.Tensor) -> bool:
    """Triton present and CUDA half precision with unit stride over the vocabulary (or the
    Triton interpreter, for tests)."""
    if triton is None or logits.dim() != 2 or logits.stride(-1) != 1:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)


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
            targets,
            logp,
            lse,
            entropy,
            logits.stride(0),
            vocab,
            float(temperature),
            WITH_ENTROPY=with_entropy,
            BLOCK=BLOCK,
            num_warps=8,
        )
    return logp, lse, entropy


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
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            inside = cols < vocab
            z = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
            z = z / temperature
            new_m = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - new_m)  # 0 on the first block (m = -inf)
            e = tl.exp(z - new_m)  # 0 outside the vocabulary
            s = s * scale + tl.sum(e, 0)
            if WITH_ENTROPY:
                t = t * scale + tl.sum(tl.where(inside, e * z, 0.0), 0)
            m = new_m
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row)
        z_t = tl.load(base + target).to(tl.float32) / temperature
        tl.store(logp_ptr + row, z_t - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, lse - t / s)
