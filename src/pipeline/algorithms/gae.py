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
    rewards, values = rewards.to(dtype), values.to(dtype)
    valid = mask.bool()  # (batch, seq)
    if rewards.shape[1] == 0:  # no tokens at all (e.g. a rank's empty shard of a small group)
        return rewards.new_zeros(rewards.shape), rewards.new_zeros(rewards.shape)
    next_value = rewards.new_zeros(rewards.shape[0])  # (batch,) V at the next valid token
    next_adv = rewards.new_zeros(rewards.shape[0])  # (batch,) advantage at the next valid token
    advantages = []
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (batch,)
        adv_t = delta + gamma * lam * next_adv  # (batch,)
        ok = valid[:, t]  # (batch,)
        next_value = torch.where(ok, values[:, t], next_value)
        next_adv = torch.where(ok, adv_t, next_adv)
        advantages.append(torch.where(ok, adv_t, 0.0))
    adv = torch.stack(advantages[::-1], dim=1)  # (batch, seq)
    returns = torch.where(valid, adv + values, 0.0)  # (batch, seq)
    return adv, returns
