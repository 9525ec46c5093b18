from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import agg_loss, masked_mean, masked_var
from pipeline.errors import ConfigError

from ._helpers import (
    AGG_MODES,
    ATOL64,
    MASK_KINDS,
    SHAPES,
    make_mask,
    poison,
    ref_agg,
    rng_for,
    t,
)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_reference(shape, kind, mode):
    rng = rng_for(shape, kind, mode)
    mask = make_mask(rng, *shape, kind)
    loss = rng.normal(size=shape)
    got = agg_loss(t(poison(loss, mask)), t(mask), mode)
    np.testing.assert_allclose(got.item(), ref_agg(loss, mask, mode), rtol=0, atol=ATOL64)


def test_modes_differ_on_uneven_lengths():
    """Guards against the modes silently aliasing each other."""
    loss = np.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=bool)
    got = [agg_loss(t(loss), t(mask), m).item() for m in AGG_MODES]
    assert got == pytest.approx([8 / 5, 4.0, 2.5])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_rows_are_left_out_and_empty_batch_is_zero(mode):
    rng = rng_for("empty", mode)
    mask = make_mask(rng, 4, 6, "holes")
    mask[2] = False
    loss = rng.normal(size=(4, 6))
    got = agg_loss(t(loss), t(mask), mode).item()
    np.testing.assert_allclose(got, ref_agg(loss, mask, mode), rtol=0, atol=ATOL64)
    empty = agg_loss(t(poison(loss, mask & False)), torch.zeros(4, 6), mode)
    assert empty.item() == 0.0


def test_float32_and_float_weights():
    rng = rng_for("weights")
    weights = rng.random((3, 5)) * (rng.random((3, 5)) < 0.7)
    loss = rng.normal(size=(3, 5))
    got = agg_loss(t(loss, torch.float32), t(weights, torch.float32), "token-mean")
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.item(), (loss * weights).sum() / weights.sum(), rtol=1e-6)


def test_masked_var_is_bessel_corrected_over_valid_tokens():
    rng = rng_for("var")
    mask = make_mask(rng, 4, 9, "mixed")
    x = rng.normal(size=(4, 9))
    np.testing.assert_allclose(
        masked_var(t(x), t(mask)).item(), np.var(x[mask], ddof=1), atol=ATOL64
    )
    np.testing.assert_allclose(masked_mean(t(x), t(mask)).item(), np.mean(x[mask]), atol=ATOL64)


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"algorithm\.loss_agg_mode"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq-sum")  # type: ignore[arg-type]
