from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import clipped_value_loss
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


def ref_value(v, old, ret, mask, clip):
    """Per-token 0.5 * max(unclipped, clipped) squared error, its gradient, and clip flags."""
    loss = np.zeros(v.shape)
    grad = np.zeros(v.shape)
    clipped = np.zeros(v.shape, dtype=bool)
    for b, s in zip(*np.nonzero(mask), strict=True):
        e1 = (v[b, s] - ret[b, s]) ** 2
        if clip is None:
            e2 = -1.0
        else:
            vc = old[b, s] + clip if v[b, s] > old[b, s] + clip else v[b, s]
            vc = old[b, s] - clip if v[b, s] < old[b, s] - clip else vc
            e2 = (vc - ret[b, s]) ** 2
        loss[b, s] = 0.5 * max(e1, e2)
        clipped[b, s] = e2 > e1
        # the clipped error only wins when V left the band, where it is constant in V
        grad[b, s] = 0.0 if e2 > e1 else v[b, s] - ret[b, s]
    return loss, grad, clipped


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_reference(shape, kind, mode, clip):
    rng = rng_for(shape, kind, mode, clip)
    mask = make_mask(rng, *shape, kind)
    old = rng.normal(size=shape)
    v = old + rng.normal(scale=0.3, size=shape)
    ret = old + rng.normal(size=shape)
    x = t(v).requires_grad_(True)
    loss, m = clipped_value_loss(
        x, t(poison(old, mask)), t(poison(ret, mask)), t(mask), clip_range=clip, loss_agg_mode=mode
    )
    ref_loss, ref_grad, clipped = ref_value(v, old, ret, mask, clip)
    np.testing.assert_allclose(loss.item(), ref_agg(ref_loss, mask, mode), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(m.clip_frac.item(), clipped[mask].mean(), atol=ATOL64)
    if mode == "token-mean":
        loss.backward()
        want = ref_grad * mask / mask.sum()
        np.testing.assert_allclose(np_of(x.grad), want, rtol=0, atol=ATOL64)


def test_clipping_is_exercised_and_float32():
    rng = rng_for("f32")
    mask = make_mask(rng, 6, 16, "holes")
    old = rng.normal(size=(6, 16))
    v = old + rng.normal(scale=0.5, size=(6, 16))
    ret = old + rng.normal(size=(6, 16))
    f32 = torch.float32
    loss, m = clipped_value_loss(t(v, f32), t(old, f32), t(ret, f32), torch.from_numpy(mask))
    ref_loss, _, clipped = ref_value(v, old, ret, mask, 0.5)
    assert 0 < clipped[mask].mean() < 1 and loss.dtype == f32
    np.testing.assert_allclose(loss.item(), ref_loss[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m.clip_frac.item(), clipped[mask].mean(), atol=1e-6)


def test_non_positive_clip_is_a_config_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match=r"algorithm\.value_clip"):
        clipped_value_loss(x, x, x, torch.ones(1, 2), clip_range=0.0)
