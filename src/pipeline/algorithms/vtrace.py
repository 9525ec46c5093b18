"""V-trace off-policy value targets and advantages (Espeholt et al., 2018), per token.

Used when the rollout engine's policy (behaviour, mu) lags the learner (target, pi): the
truncated ratios keep the value targets' variance bounded while correcting most of the bias.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.algorithms.masking import check_same_shape
from pipeline.errors import ConfigError


def _truncated_ratio(log_ratio: Tensor, bar: float) -> Tensor:
    """min(bar, exp(log_ratio)), clamped in log space so a huge ratio cannot overflow."""
    return torch.exp(torch.clamp(log_ratio, max=math.log(bar)))


@torch.no_grad()
def compute_vtrace(
    rewards: Tensor,
    values: Tensor,
    target_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """V-trace policy-gradient advantages and value targets v_s, both (batch, seq).

    rho_t = min(rho_bar, pi/mu), c_t = lam * min(c_bar, pi/mu);
    v_s - V_s = rho_s delta_s + gamma c_s (v_{s+1} - V_{s+1}),
    delta_s = r_s + gamma V_{s+1} - V_s; advantage_s = rho_s (r_s + gamma v_{s+1} - V_s).
    Masked tokens are jumped over like in GAE and the episode ends after the last valid token
    (V and v are 0 there). With pi == mu and rho_bar = c_bar = 1, v_s are the GAE-lambda returns.
    """
    check_same_shape(
        rewards=rewards,
        values=values,
        target_logp=target_logp,
        behaviour_logp=behaviour_logp,
        mask=mask,
    )
    for name, bar in (("vtrace_rho_bar", rho_bar), ("vtrace_c_bar", c_bar)):
        if not bar > 0:
            raise ConfigError(f"set algorithm.{name} to a value > 0 (got {bar})")
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    valid = mask.bool()  # (batch, seq)
    if rewards.shape[1] == 0:  # no tokens at all (e.g. a rank's empty shard of a small group)
        return rewards.new_zeros(rewards.shape), rewards.new_zeros(rewards.shape)
    log_ratio = torch.where(valid, (target_logp - behaviour_logp).to(dtype), 0.0)  # (batch, seq)
    rhos = _truncated_ratio(log_ratio, rho_bar)  # (batch, seq)
    cs = lam * _truncated_ratio(log_ratio, c_bar)  # (batch, seq)
    batch = rewards.shape[0]
    next_value = rewards.new_zeros(batch)  # (batch,) V at the next valid token
    next_correction = rewards.new_zeros(batch)  # (batch,) v - V at the next valid token
    targets, advantages = [], []
    for t in range(rewards.shape[1] - 1, -1, -1):
        ok = valid[:, t]  # (batch,)
        next_target = next_value + next_correction  # (batch,) v_{t+1}
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (batch,)
        correction = rhos[:, t] * delta + gamma * cs[:, t] * next_correction  # (batch,)
        adv_t = rhos[:, t] * (rewards[:, t] + gamma * next_target - values[:, t])  # (batch,)
        targets.append(torch.where(ok, values[:, t] + correction, 0.0))
        advantages.append(torch.where(ok, adv_t, 0.0))
        next_value = torch.where(ok, values[:, t], next_value)
        next_correction = torch.where(ok, correction, next_correction)
    adv = torch.stack(advantages[::-1], dim=1)  # (batch, seq)
    vs = torch.stack(targets[::-1], dim=1)  # (batch, seq)
    return adv, vs
