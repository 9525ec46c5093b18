"""Half precision runs through every function and stays close to the float64 result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import (
    clipped_value_loss,
    compute_gae,
    compute_vtrace,
    grpo_advantages,
    kl_penalty_rewards,
    masked_whiten,
    ppo_policy_loss,
    truncated_is_weights,
)

from ._helpers import make_mask, rng_for, t


def _run_all(dtype, rng):
    shape = (4, 12)
    mask = torch.from_numpy(make_mask(rng, *shape, "mixed"))
    rewards, values, adv = (t(rng.normal(size=shape), dtype) for _ in range(3))
    behaviour = t(-rng.exponential(1.0, size=shape), dtype)
    logp = behaviour + t(rng.normal(scale=0.1, size=shape), dtype)
    groups = torch.tensor([0, 0, 1, 1])
    return [
        *compute_gae(rewards, values, mask, gamma=0.99, lam=0.95),
        *compute_vtrace(rewards, values, logp, behaviour, mask, gamma=0.99, lam=0.95),
        kl_penalty_rewards(rewards[:, 0], logp, behaviour, mask, 0.1, "k3")[0],
        ppo_policy_loss(logp, behaviour, adv, mask)[0],
        clipped_value_loss(values, rewards, adv, mask)[0],
        masked_whiten(adv, mask),
        grpo_advantages(rewards[:, 0], groups, mask),
        truncated_is_weights(logp, behaviour, mask),
    ]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_keeps_dtype_and_tracks_float64(dtype, tol):
    got = _run_all(dtype, rng_for("dtype"))
    want = _run_all(torch.float64, rng_for("dtype"))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(g.double().numpy(), w.numpy(), rtol=tol, atol=tol)
