from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import kl_estimate, kl_k3, kl_loss, kl_penalty_rewards
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


def ref_kl(logp, ref, estimator):
    out = np.zeros_like(logp)
    for i in np.ndindex(logp.shape):
        d = logp[i] - ref[i]
        if estimator == "k1":
            out[i] = d
        elif estimator == "k2":
            out[i] = d * d / 2
        else:
            x = min(max(-d, -20.0), 20.0)
            out[i] = min(max(np.exp(x) - x - 1, -10.0), 10.0)
    return out


def _logps(rng, shape):
    logp = -rng.exponential(2.0, size=shape)
    return logp, logp + rng.normal(scale=0.7, size=shape)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_estimators_match_reference(estimator):
    logp, ref = _logps(rng_for(estimator), (5, 9))
    got = kl_estimate(t(logp), t(ref), estimator)
    np.testing.assert_allclose(np_of(got), ref_kl(logp, ref, estimator), rtol=0, atol=ATOL64)


def test_k3_clamps_like_verl_and_is_nonnegative():
    logp = torch.tensor([0.0, 0.0, 0.0, -30.0, -1e-9], dtype=torch.float64)
    ref = torch.tensor([30.0, 2.0, -8.0, 0.0, 0.0], dtype=torch.float64)
    got = kl_k3(logp, ref).numpy()
    want = [10.0, np.exp(2.0) - 3.0, np.exp(-8.0) + 7.0, 10.0]  # 29 is clamped to 10
    np.testing.assert_allclose(got[:4], want, rtol=1e-12)
    assert 0 <= got[4] < 1e-17  # exp(x) - x - 1 would cancel to 0 or below here


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_penalty_rewards_put_score_on_last_valid_token(shape, kind, estimator):
    rng = rng_for(shape, kind, estimator)
    mask = make_mask(rng, *shape, kind)
    logp, ref = _logps(rng, shape)
    scores = rng.normal(size=shape[0])
    coef = 0.3
    rewards, kl = kl_penalty_rewards(
        t(scores), t(poison(logp, mask)), t(poison(ref, mask)), t(mask), coef, estimator
    )
    want_kl = np.zeros(shape)
    want = np.zeros(shape)
    per_token = ref_kl(logp, ref, estimator)
    for b in range(shape[0]):
        idx = np.flatnonzero(mask[b])
        want_kl[b, idx] = per_token[b, idx]
        want[b, idx] = -coef * per_token[b, idx]
        want[b, idx[-1]] += scores[b]
    np.testing.assert_allclose(np_of(kl), want_kl, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(np_of(rewards), want, rtol=0, atol=ATOL64)


def test_penalty_rewards_accept_token_scores_and_float32():
    rng = rng_for("token-scores")
    mask = make_mask(rng, 4, 10, "holes")
    logp, ref = _logps(rng, (4, 10))
    token_scores = rng.normal(size=(4, 10))
    f32 = torch.float32
    rewards, _ = kl_penalty_rewards(
        t(token_scores, f32), t(logp, f32), t(ref, f32), torch.from_numpy(mask), 0.1, "k2"
    )
    want = np.where(mask, token_scores - 0.1 * ref_kl(logp, ref, "k2"), 0.0)
    assert rewards.dtype == f32
    np.testing.assert_allclose(np_of(rewards), want, rtol=1e-6, atol=1e-6)


def test_row_without_valid_tokens_drops_its_score():
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    rewards, _ = kl_penalty_rewards(
        torch.tensor([5.0, 7.0], dtype=torch.float64), zeros, zeros, mask, 1.0
    )
    assert rewards.tolist() == [[0.0, 0.0, 0.0], [0.0, 7.0, 0.0]]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_loss_aggregates_and_has_gradient(mode):
    rng = rng_for("kl-loss", mode)
    mask = make_mask(rng, 5, 8, "mixed")
    logp, ref = _logps(rng, (5, 8))
    x = t(logp).requires_grad_(True)
    loss = kl_loss(x, t(poison(ref, mask)), t(mask), estimator="k3", loss_agg_mode=mode)
    want = ref_agg(ref_kl(logp, ref, "k3"), mask, mode)
    np.testing.assert_allclose(loss.item(), want, rtol=0, atol=ATOL64)
    loss.backward()
    assert torch.all(x.grad[~torch.from_numpy(mask)] == 0) and x.grad.abs().sum() > 0
    if mode == "token-mean":  # d k3 / d logp = 1 - exp(ref - logp), per valid token
        want = np.where(mask, 1 - np.exp(ref - logp), 0.0) / mask.sum()
        np.testing.assert_allclose(np_of(x.grad), want, rtol=0, atol=ATOL64)


def test_unknown_estimator_is_a_config_error():
    with pytest.raises(ConfigError, match="kl_estimator"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]
