"""The untruncated sampler as two Triton kernels: each row's logits read once.

`sampling.sample` without top-k / top-p needs, per row, log_softmax(z)[token] and the argmax
of z + Gumbel noise (z = logits / T; no noise on greedy rows). Compiled from torch ops that
is one reduction per row over the 152k vocabulary, a sizeable share of a decode step at
large batches. Here a (row, vocabulary split) grid streams each split once with an
online softmax (running maximum m, per-lane sums of exp(z - m)) and a running best of
z + noise, the noise hashed in place from the same counters as `rng.GumbelNoise`; a second
kernel merges a row's splits and reads the chosen token's logit. Ties go to the lowest
vocabulary id, as torch.argmax.

Numerics: float32 throughout, z = logits / T as in the torch version; the noise is the same
23-bit uniform through -log(-log(u)).
"""

from __future__ import annotations

import torch

from pipeline.engines.rng import HASH_I32
from pipeline.models.triton_support import half_kernel_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch version serves
    triton = None

BLOCK = 2048  # vocabulary entries per inner step
# programs of the first kernel across the batch: enough to fill a large GPU's SMs a few
# times over at any batch size
TARGET_PROGRAMS = 1024


def supported(output_weight: torch.Tensor) -> bool:
    """Triton present and the output layer (whose dtype the logits have) in CUDA half
    precision, or the Triton interpreter (tests)."""
    return half_kernel_runs(output_weight)


def _splits(rows: int, vocab: int) -> tuple[int, int]:
    """(splits per row, vocabulary entries per split, a multiple of BLOCK)."""
    blocks = triton.cdiv(vocab, BLOCK)
    splits = max(1, min(blocks, triton.cdiv(TARGET_PROGRAMS, max(rows, 1))))
    per_split = triton.cdiv(blocks, splits) * BLOCK
    return triton.cdiv(vocab, per_split), per_split


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    token_index: torch.Tensor,
    vocab_hash: torch.Tensor,
    *,
    noise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (b,) int64 and log-probs (b,) float32 of `sampling.sample` with truncate off.

    temperature (b,) float32 (<= 0: greedy, scored at T = 1); keys (b,) int32 and
    token_index (b,) int64 the noise counters; vocab_hash (vocab,) int32 from GumbelNoise.
    noise=False: every row greedy (no noise drawn).
    """
    b, vocab = logits.shape
    assert logits.stride(-1) == 1, "the kernels read the vocabulary with unit stride"
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    splits, per_split = _splits(b, vocab)
    partial = torch.empty((3, b, splits), dtype=torch.float32, device=logits.device)
    best_ids = torch.empty((b, splits), dtype=torch.int32, device=logits.device)
    temperature = temperature.float().contiguous()
    _split_kernel[(b, splits)](
        logits,
        temperature,
        keys.to(torch.int32).contiguous(),
        token_index.to(torch.int32).contiguous(),
        vocab_hash,
        partial,
        best_ids,
        logits.stride(0),
        vocab,
        per_split,
        splits,
        b * splits,
        NOISE=noise,
        BLOCK=BLOCK,
        num_warps=4,
    )
    _merge_kernel[(b,)](
        logits,
        temperature,
        partial,
        best_ids,
        tokens,
        logprobs,
        logits.stride(0),
        splits,
        b * splits,
        SPLITS=triton.next_power_of_2(splits),
        num_warps=1,
    )
    return tokens, logprobs


if triton is not None:
    # the hash constants of rng.py as int32 bit patterns (Triton kernels read constexprs only)
    _M1_I32 = tl.constexpr(HASH_I32[0])
    _M2_I32 = tl.constexpr(HASH_I32[1])
    _SALT_I32 = tl.constexpr(HASH_I32[2])

    @triton.jit
    def _shr(x, s: tl.constexpr):
        return (x >> s) & ((1 << (32 - s)) - 1)  # logical shift of an int32 bit pattern

    @triton.jit
    def _mix32(x):
        x = x ^ _shr(x, 16)
        x = x * _M1_I32
        x = x ^ _shr(x, 15)
        x = x * _M2_I32
        return x ^ _shr(x, 16)

    @triton.jit
    def _split_kernel(
        logits_ptr,
        temp_ptr,
        keys_ptr,
        index_ptr,
        hash_ptr,
        partial_ptr,
        best_ids_ptr,
        stride_row,
        vocab,
        per_split,
        splits,
        plane,
        NOISE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        split = tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride_row
        t = tl.load(temp_ptr + row)
        greedy = t <= 0.0
        t = tl.where(greedy, 1.0, t)
        row_hash = _mix32(tl.load(keys_ptr + row) ^ _mix32(tl.load(index_ptr + row) ^ _SALT_I32))
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)  # per lane, rescaled to the running maximum
        best = tl.full((), float("-inf"), tl.float32)
        best_id = tl.full((), 0, tl.int32)
        start = split * per_split
        for step in range(0, per_split, BLOCK):
            cols = start + step + offs
            inside = cols < vocab
            z = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) / t
            new_m = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - new_m) + tl.exp(z - new_m)  # 0 outside the vocabulary
            m = new_m
            score = z
            if NOISE:
                bits = _mix32(tl.load(hash_ptr + cols, mask=inside, other=0) ^ row_hash)
                u = (_shr(bits, 9).to(tl.float32) + 0.5) * (2.0**-23)
                score = tl.where(greedy, z, z - tl.log(-tl.log(u)))
            score = tl.where(inside, score, float("-inf"))
            block_best = tl.max(score, 0)
            block_id = tl.argmax(score, 0).to(tl.int32) + start + step
            take = block_best > best  # an earlier block keeps a tie
            best_id = tl.where(take, block_id, best_id)
            best = tl.where(take, block_best, best)
        at = row * splits + split
        tl.store(partial_ptr + at, m)
        tl.store(partial_ptr + plane + at, tl.sum(s, 0))
        tl.store(partial_ptr + 2 * plane + at, best)
        tl.store(best_ids_ptr + at, best_id)

    @triton.jit
    def _merge_kernel(
        logits_ptr,
        temp_ptr,
        partial_ptr,
        best_ids_ptr,
        tokens_ptr,
        logprobs_ptr,
        stride_row,
        splits,
        plane,
        SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, SPLITS)
        inside = offs < splits
        at = row * splits + offs
        m = tl.load(partial_ptr + at, mask=inside, other=float("-inf"))
        s = tl.load(partial_ptr + plane + at, mask=inside, other=0.0)
        best = tl.load(partial_ptr + 2 * plane + at, mask=inside, other=float("-inf"))
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        winner = tl.argmax(best, 0)  # the lowest split among equals
        token = tl.sum(tl.where(offs == winner, tl.load(best_ids_ptr + at, mask=inside), 0), 0)
        t = tl.load(temp_ptr + row)
        t = tl.where(t <= 0.0, 1.0, t)
        z = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32) / t
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, z - lse)
