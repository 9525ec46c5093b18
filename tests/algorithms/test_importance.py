from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import mismatch_metrics, truncated_is_weights
from pipeline.errors import ConfigError

from ._helpers import ATOL64, MASK_KINDS, SHAPES, make_mask, np_of, poison, rng_for, t


def ref_weights(learner, behaviour, mask, cap, level):
    w = np.zeros(learner.shape)
    hit = np.zeros(learner.shape, dtype=bool)
    cap = np.inf if cap is None else cap
    for b in range(learner.shape[0]):
        idx = np.flatnonzero(mask[b])
        ratios = np.exp(learner[b, idx] - behaviour[b, idx])
        if level == "sequence":
            ratios = np.full(len(idx), np.prod(ratios))
        w[b, idx] = np.minimum(ratios, cap)
        hit[b, idx] = ratios > cap
    return w, hit


def _inputs(rng, shape, kind):
    mask = make_mask(rng, *shape, kind)
    behaviour = -rng.exponential(2.0, size=shape)
    learner = behaviour + rng.normal(scale=0.5, size=shape)
    return mask, learner, behaviour


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(("cap", "level"), [(2.0, "token"), (None, "token"), (3.0, "sequence")])
def test_weights_and_metrics_match_reference(shape, kind, cap, level):
    rng = rng_for(shape, kind, cap, level)
    mask, learner, behaviour = _inputs(rng, shape, kind)
    args = (t(poison(learner, mask)), t(poison(behaviour, mask)), t(mask))
    w = truncated_is_weights(*args, cap=cap, level=level)
    m = mismatch_metrics(*args, cap=cap, level=level)
    want_w, hit = ref_weights(learner, behaviour, mask, cap, level)
    np.testing.assert_allclose(np_of(w), want_w, rtol=1e-13, atol=ATOL64)
    diff = (learner - behaviour)[mask]
    ratio = np.exp(diff)
    np.testing.assert_allclose(m.kl.item(), np.mean(ratio - 1 - diff), atol=ATOL64)
    np.testing.assert_allclose(m.mean_abs_diff.item(), np.mean(np.abs(diff)), atol=ATOL64)
    np.testing.assert_allclose(m.max_abs_diff.item(), np.max(np.abs(diff)), atol=ATOL64)
    np.testing.assert_allclose(m.truncated_frac.item(), hit[mask].mean(), atol=ATOL64)
    if shape == (6, 20) and cap == 2.0:
        assert 0 < hit[mask].mean() < 1  # truncation is really exercised


def test_weights_have_no_gradient_and_float32():
    rng = rng_for("f32")
    mask, learner, behaviour = _inputs(rng, (4, 10), "holes")
    x = t(learner, torch.float32).requires_grad_(True)
    w = truncated_is_weights(x, t(behaviour, torch.float32), torch.from_numpy(mask), cap=1.5)
    assert not w.requires_grad and w.dtype == torch.float32
    want, _ = ref_weights(learner, behaviour, mask, 1.5, "token")
    np.testing.assert_allclose(np_of(w), want, rtol=1e-5, atol=1e-6)


def test_long_sequence_ratio_does_not_overflow():
    learner = torch.zeros(1, 4000, dtype=torch.float64)
    behaviour = learner - 0.5  # product of ratios = exp(2000)
    w = truncated_is_weights(learner, behaviour, torch.ones(1, 4000), cap=2.0, level="sequence")
    assert torch.all(w == 2.0)


def test_bad_level_and_cap_are_config_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match=r"algorithm\.is_level"):
        truncated_is_weights(x, x, torch.ones(1, 2), level="batch")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"algorithm\.is_cap"):
        truncated_is_weights(x, x, torch.ones(1, 2), cap=0.0)
