"""Generalised advantage estimation over (batch, seq) token rewards with arbitrary masks."""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.algorithms.masking import check_same_shape


@torch.no_grad()
def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) advantages and returns, both (batch, seq), zero where masked.

    Masked tokens are jumped over rather than treated as zero-reward steps: the bootstrap
    value and the carried advantage come from the next *valid* token, so left padding, right
    padding and holes (e.g. tool-output tokens) do not change the result. The value after the
    last valid token is 0 (the episode ends there). Computed without grad: advantages and
    returns are regression/policy targets, never differentiated through.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    valid = mask.bool()  # (batch, seq)
    rows, seq = rewards.shape
    if seq == 0:  # no tokens at all (e.g. a rank's empty shard of a small group)
        empty = rewards.new_zeros(rewards.shape, dtype=dtype)
        return empty, empty.clone()
    # each row's valid tokens moved to its front, in order: the recursion then runs over
    # contiguous steps, a block of them at a time (not a Python loop over tokens)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # (batch, seq)
    live = torch.arange(seq, device=valid.device) < valid.sum(dim=1, keepdim=True)
    r = torch.where(live, rewards.double().gather(1, order), 0.0)  # (batch, seq)
    v = torch.where(live, values.double().gather(1, order), 0.0)  # (batch, seq)
    next_v = torch.cat([v[:, 1:], v.new_zeros(rows, 1)], dim=1)  # 0 after the last token
    delta = torch.where(live, r + gamma * next_v - v, 0.0)  # (batch, seq)
    compact = _discounted_suffix_sums(delta, gamma * lam)
    adv = torch.zeros_like(compact).scatter_(1, order, compact)
    adv = torch.where(valid, adv, 0.0)
    returns = torch.where(valid, adv + values.double(), 0.0)  # (batch, seq)
    return adv.to(dtype), returns.to(dtype)


def _discounted_suffix_sums(x: Tensor, decay: float, block: int = 64) -> Tensor:
    """out[:, i] = sum over j >= i of decay^(j - i) * x[:, j], float64, by blocks from the
    end: within a block a (block, block) matrix of powers, across blocks the carried sum."""
    rows, seq = x.shape
    n = min(block, seq)
    k = torch.arange(n, device=x.device, dtype=torch.float64)
    lag = k[None, :] - k[:, None]  # (n, n): j - i
    base = torch.tensor(decay, dtype=torch.float64, device=x.device)
    powers = torch.where(lag >= 0, base ** lag.clamp(min=0), 0.0)  # (n, n) [i, j]
    out = torch.empty_like(x)
    carry = x.new_zeros(rows)  # the sum at the first position after the block
    for end in range(seq, 0, -n):
        start = max(0, end - n)
        size = end - start
        tail = base ** (size - k[:size])  # (size,) decay^(size - i)
        out[:, start:end] = x[:, start:end] @ powers[:size, :size].T + carry[:, None] * tail
        carry = out[:, start]
    return out
