from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import ppo_policy_loss
from pipeline.errors import ConfigError

from ._helpers import (
    AGG_MODES,
    ATOL64,
    MASK_KINDS,
    SHAPES,
    make_mask,
    np_of,
    poison,
    ref_agg,
    rng_for,
    t,
)

LOW, HIGH, C = 0.2, 0.28, 3.0


def ref_policy(logp, old, adv, mask, low, high, c, weights=None):
    """Per-token PPO loss and d loss_t / d logp_t, by ratio region rather than max/min.

    A > 0: loss = -A min(r, 1 + high), gradient -A r while r <= 1 + high.
    A < 0: loss = -A min(max(r, 1 - low), c), gradient -A r while 1 - low <= r <= c.
    """
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    clipped = np.zeros(logp.shape, dtype=bool)
    lower = np.zeros(logp.shape, dtype=bool)
    cap = np.inf if c is None else c
    for b, s in zip(*np.nonzero(mask), strict=True):
        r = np.exp(logp[b, s] - old[b, s])
        a = adv[b, s]
        w = 1.0 if weights is None else weights[b, s]
        if a > 0:
            loss[b, s] = -a * min(r, 1 + high)
            grad[b, s] = -a * r if r <= 1 + high else 0.0
            clipped[b, s] = r > 1 + high
        elif a < 0:
            loss[b, s] = -a * min(max(r, 1 - low), cap)
            grad[b, s] = -a * r if 1 - low <= r <= cap else 0.0
            clipped[b, s] = r < 1 - low
            lower[b, s] = r > cap
        loss[b, s] *= w
        grad[b, s] *= w
    return loss, grad, clipped, lower


def grad_scale(mask, mode):
    """d aggregate / d loss_t for the valid tokens of each aggregation mode."""
    n_seq = mask.any(axis=1).sum()
    per_row = mask.sum(axis=1, keepdims=True)
    if mode == "token-mean":
        return mask / mask.sum()
    if mode == "seq-mean-token-sum":
        return mask / n_seq
    return mask / np.maximum(per_row, 1) / n_seq


def _inputs(rng, shape, kind, spread=0.4):
    mask = make_mask(rng, *shape, kind)
    old = -rng.exponential(2.0, size=shape)
    logp = old + rng.normal(scale=spread, size=shape)
    adv = rng.normal(size=shape)
    return mask, logp, old, adv


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_metrics_and_gradient_match_reference(shape, kind, mode):
    rng = rng_for(shape, kind, mode)
    mask, logp, old, adv = _inputs(rng, shape, kind)
    x = t(poison(logp, mask)).nan_to_num(0.0).requires_grad_(True)
    loss, m = ppo_policy_loss(
        x, t(poison(old, mask)), t(poison(adv, mask)), t(mask),
        clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C, loss_agg_mode=mode,
    )  # fmt: skip
    ref_loss, ref_grad, clipped, lower = ref_policy(logp, old, adv, mask, LOW, HIGH, C)
    np.testing.assert_allclose(loss.item(), ref_agg(ref_loss, mask, mode), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(m.clip_frac.item(), clipped[mask].mean(), atol=ATOL64)
    np.testing.assert_allclose(m.clip_frac_lower.item(), lower[mask].mean(), atol=ATOL64)
    np.testing.assert_allclose(m.approx_kl.item(), np.mean((old - logp)[mask]), atol=ATOL64)
    loss.backward()
    want_grad = ref_grad * grad_scale(mask, mode)
    np.testing.assert_allclose(np_of(x.grad), want_grad, rtol=0, atol=ATOL64)


def test_dual_clip_caps_negative_advantages():
    rng = rng_for("dual")
    mask = make_mask(rng, 6, 16, "mixed")
    old = -rng.exponential(2.0, size=(6, 16))
    logp = old + rng.uniform(-0.5, 2.0, size=(6, 16))  # ratios from 0.6 to 7.4
    adv = -rng.uniform(0.1, 2.0, size=(6, 16))  # all negative
    loss, m = ppo_policy_loss(t(logp), t(old), t(adv), t(mask), clip_ratio_c=C)
    ref_loss, _, _, lower = ref_policy(logp, old, adv, mask, 0.2, 0.2, C)
    assert 0 < lower[mask].mean() < 1  # the case really has capped and uncapped tokens
    np.testing.assert_allclose(loss.item(), ref_loss[mask].mean(), atol=ATOL64)
    np.testing.assert_allclose(m.clip_frac_lower.item(), lower[mask].mean(), atol=ATOL64)
    # Without the dual clip the same batch is worse: unbounded -A * r.
    plain, m_plain = ppo_policy_loss(t(logp), t(old), t(adv), t(mask), clip_ratio_c=None)
    ref_plain, _, _, _ = ref_policy(logp, old, adv, mask, 0.2, 0.2, None)
    np.testing.assert_allclose(plain.item(), ref_plain[mask].mean(), atol=ATOL64)
    assert plain.item() > loss.item() and m_plain.clip_frac_lower.item() == 0.0


def test_importance_weights_scale_loss_and_gradient_without_their_own_gradient():
    rng = rng_for("is")
    mask, logp, old, adv = _inputs(rng, (5, 12), "holes")
    weights = np.where(mask, rng.uniform(0.2, 2.0, size=(5, 12)), 0.0)
    x = t(logp).requires_grad_(True)
    w = t(weights).requires_grad_(True)
    loss, _ = ppo_policy_loss(x, t(old), t(adv), t(mask), is_weights=w)
    ref_loss, ref_grad, _, _ = ref_policy(logp, old, adv, mask, 0.2, 0.2, 3.0, weights)
    np.testing.assert_allclose(loss.item(), ref_loss[mask].mean(), atol=ATOL64)
    loss.backward()
    np.testing.assert_allclose(np_of(x.grad), ref_grad * mask / mask.sum(), atol=ATOL64)
    assert w.grad is None


def test_float32():
    rng = rng_for("f32")
    mask, logp, old, adv = _inputs(rng, (4, 10), "right")
    f32 = torch.float32
    loss, m = ppo_policy_loss(t(logp, f32), t(old, f32), t(adv, f32), torch.from_numpy(mask))
    ref_loss, _, clipped, _ = ref_policy(logp, old, adv, mask, 0.2, 0.2, 3.0)
    assert loss.dtype == f32
    np.testing.assert_allclose(loss.item(), ref_loss[mask].mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.clip_frac.item(), clipped[mask].mean(), atol=1e-6)


def test_clip_ratio_c_must_exceed_one():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match=r"algorithm\.clip_ratio_c"):
        ppo_policy_loss(x, x, x, torch.ones(1, 2), clip_ratio_c=1.0)
