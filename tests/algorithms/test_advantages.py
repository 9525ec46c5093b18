from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import grpo_advantages, masked_whiten, rloo_advantages

from ._helpers import ATOL64, MASK_KINDS, SHAPES, make_mask, np_of, poison, rng_for, t


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] * s[1] > 1])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_reference(shape, kind, shift_mean):
    rng = rng_for(shape, kind, shift_mean)
    mask = make_mask(rng, *shape, kind)
    mask[0, :2] = True  # at least two valid tokens for an unbiased variance
    x = rng.normal(loc=2.0, scale=3.0, size=shape)
    got = masked_whiten(t(poison(x, mask)), t(mask), shift_mean=shift_mean)
    valid = x[mask]
    mean, var = valid.mean(), valid.var(ddof=1)
    want = np.zeros(shape)
    for b, s in zip(*np.nonzero(mask), strict=True):
        want[b, s] = (x[b, s] - mean) / np.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    np.testing.assert_allclose(np_of(got), want, rtol=0, atol=ATOL64)


def ref_group(scores, groups, mode, norm_by_std=True, eps=1e-6):
    """One loop per sequence over its group's members; groups of one get 0."""
    out = np.zeros(len(scores))
    for i, g in enumerate(groups):
        members = [scores[j] for j in range(len(scores)) if groups[j] == g]
        others = [scores[j] for j in range(len(scores)) if groups[j] == g and j != i]
        if not others:
            continue
        if mode == "rloo":
            out[i] = scores[i] - sum(others) / len(others)
        else:
            out[i] = scores[i] - np.mean(members)
            if norm_by_std:
                out[i] /= np.std(members, ddof=1) + eps
    return out


def _groups(rng):
    """Uneven, non-contiguous, unsorted groups, including a singleton."""
    sizes = {17: 1, 3: 2, 42: 3, 5: 4, 8: 6}
    groups = np.concatenate([np.full(n, g) for g, n in sizes.items()])
    return rng.permutation(groups)


@pytest.mark.parametrize("mode", ["grpo", "grpo-no-std", "rloo"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_group_baselines_with_uneven_groups(mode, kind):
    rng = rng_for(mode, kind)
    groups = _groups(rng)
    scores = rng.normal(size=len(groups))
    mask = make_mask(rng, len(groups), 9, kind)
    if mode == "rloo":
        got = rloo_advantages(t(scores), torch.from_numpy(groups), t(mask))
        per_seq = ref_group(scores, groups, "rloo")
    else:
        norm = mode == "grpo"
        got = grpo_advantages(t(scores), torch.from_numpy(groups), t(mask), norm_by_std=norm)
        per_seq = ref_group(scores, groups, "grpo", norm_by_std=norm)
    want = np.where(mask, per_seq[:, None], 0.0)
    np.testing.assert_allclose(np_of(got), want, rtol=0, atol=ATOL64)
    assert np.all(np_of(got)[groups == 17] == 0)  # the singleton


def test_group_baselines_float32():
    rng = rng_for("f32")
    groups = _groups(rng)
    scores = rng.normal(size=len(groups))
    mask = torch.ones(len(groups), 3, dtype=torch.bool)
    got = grpo_advantages(t(scores, torch.float32), torch.from_numpy(groups), mask)
    assert got.dtype == torch.float32
    want = ref_group(scores, groups, "grpo")[:, None].repeat(3, axis=1)
    np.testing.assert_allclose(np_of(got), want, rtol=1e-5, atol=1e-5)


def test_group_inputs_are_checked():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long), torch.ones(3, 2))
