from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import compute_gae, compute_vtrace
from pipeline.errors import ConfigError

from ._helpers import ATOL64, MASK_KINDS, SHAPES, make_mask, np_of, poison, ref_gae, rng_for, t


def ref_vtrace(rewards, values, target_logp, behaviour_logp, mask, gamma, lam, rho_bar, c_bar):
    """Espeholt et al. eq. (1) as a direct sum over the compacted valid tokens.

    v_s = V_s + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t delta_t,
    advantage_s = rho_s (r_s + gamma v_{s+1} - V_s), with V and v equal to 0 past the end.
    """
    vs = np.zeros(rewards.shape)
    adv = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[b])
        n = len(idx)
        r, v = rewards[b, idx], values[b, idx]
        ratio = np.exp(target_logp[b, idx] - behaviour_logp[b, idx])
        rho = np.minimum(rho_bar, ratio)
        c = lam * np.minimum(c_bar, ratio)
        v_next = np.append(v[1:], 0.0)
        delta = r + gamma * v_next - v
        v_s = np.zeros(n)
        for s in range(n):
            total = 0.0
            for k in range(s, n):
                total += gamma ** (k - s) * np.prod(c[s:k]) * rho[k] * delta[k]
            v_s[s] = v[s] + total
        vs_next = np.append(v_s[1:], 0.0)
        vs[b, idx] = v_s
        adv[b, idx] = rho * (r + gamma * vs_next - v)
    return adv, vs


def _inputs(rng, shape, kind):
    mask = make_mask(rng, *shape, kind)
    rewards, values = rng.normal(size=shape), rng.normal(size=shape)
    behaviour = -rng.exponential(2.0, size=shape)
    target = behaviour + rng.normal(scale=0.8, size=shape)  # ratios on both sides of 1
    return mask, rewards, values, target, behaviour


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(
    ("gamma", "lam", "rho_bar", "c_bar"), [(1.0, 1.0, 1.0, 1.0), (0.95, 0.9, 2.0, 0.8)]
)
def test_vtrace_matches_numpy_reference(shape, kind, gamma, lam, rho_bar, c_bar):
    rng = rng_for(shape, kind, gamma, rho_bar)
    mask, rewards, values, target, behaviour = _inputs(rng, shape, kind)
    adv, vs = compute_vtrace(
        t(poison(rewards, mask)),
        t(poison(values, mask)),
        t(poison(target, mask)),
        t(poison(behaviour, mask)),
        t(mask),
        gamma=gamma,
        lam=lam,
        rho_bar=rho_bar,
        c_bar=c_bar,
    )
    ref_adv, ref_vs = ref_vtrace(
        rewards, values, target, behaviour, mask, gamma, lam, rho_bar, c_bar
    )
    np.testing.assert_allclose(np_of(vs), ref_vs, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(np_of(adv), ref_adv, rtol=0, atol=ATOL64)
    if shape == (6, 20) and rho_bar == 2.0:  # rho and c truncated, only c, and neither
        ratio = np.exp(target - behaviour)[mask]
        assert (ratio > rho_bar).any() and (ratio < c_bar).any()
        assert ((ratio > c_bar) & (ratio < rho_bar)).any()


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0)])
def test_on_policy_vtrace_reduces_to_gae(kind, gamma, lam):
    rng = rng_for("reduce", kind, gamma, lam)
    mask, rewards, values, _, behaviour = _inputs(rng, (6, 20), kind)
    adv, vs = compute_vtrace(
        t(rewards), t(values), t(behaviour), t(behaviour), t(mask), gamma=gamma, lam=lam
    )
    gae_adv, gae_ret = compute_gae(t(rewards), t(values), t(mask), gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np_of(vs), ref_ret, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(np_of(vs), np_of(gae_ret), rtol=0, atol=ATOL64)
    # The V-trace advantage bootstraps on v_{s+1}: delta_s + gamma A_{s+1}, GAE's when lam = 1.
    next_adv = np.zeros_like(ref_adv)
    for b in range(mask.shape[0]):
        idx = np.flatnonzero(mask[b])
        next_adv[b, idx[:-1]] = ref_adv[b, idx[1:]]
    delta = np.where(mask, ref_adv - gamma * lam * next_adv, 0.0)
    np.testing.assert_allclose(np_of(adv), delta + gamma * next_adv, rtol=0, atol=ATOL64)
    if lam == 1.0:
        np.testing.assert_allclose(np_of(adv), np_of(gae_adv), rtol=0, atol=ATOL64)


def test_vtrace_float32():
    rng = rng_for("f32")
    mask, rewards, values, target, behaviour = _inputs(rng, (4, 12), "holes")
    f32 = torch.float32
    adv, vs = compute_vtrace(
        t(rewards, f32), t(values, f32), t(target, f32), t(behaviour, f32), t(mask),
        gamma=0.99, lam=0.95, rho_bar=1.5, c_bar=1.0,
    )  # fmt: skip
    assert adv.dtype == f32 and vs.dtype == f32
    ref_adv, ref_vs = ref_vtrace(rewards, values, target, behaviour, mask, 0.99, 0.95, 1.5, 1.0)
    np.testing.assert_allclose(np_of(vs), ref_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np_of(adv), ref_adv, rtol=1e-5, atol=1e-5)


def test_huge_ratios_do_not_overflow():
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    adv, vs = compute_vtrace(
        torch.ones(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
        logp, logp - 1e4, torch.ones(1, 2), gamma=1.0,
    )  # fmt: skip
    assert torch.isfinite(adv).all() and vs.tolist() == [[2.0, 1.0]]


def test_bad_truncation_level_is_a_config_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="vtrace_c_bar"):
        compute_vtrace(x, x, x, x, torch.ones(1, 2), gamma=1.0, c_bar=0.0)
