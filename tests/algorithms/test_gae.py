from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import compute_gae

from ._helpers import ATOL64, MASK_KINDS, SHAPES, make_mask, np_of, poison, ref_gae, rng_for, t


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.97, 1.0), (0.9, 0.0)])
def test_gae_matches_numpy_reference(shape, kind, gamma, lam):
    rng = rng_for(shape, kind, gamma, lam)
    mask = make_mask(rng, *shape, kind)
    rewards = rng.normal(size=shape)
    values = rng.normal(size=shape)
    adv, ret = compute_gae(
        t(poison(rewards, mask)), t(poison(values, mask)), t(mask), gamma=gamma, lam=lam
    )
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np_of(adv), ref_adv, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(np_of(ret), ref_ret, rtol=0, atol=ATOL64)
    assert np.all(np_of(adv)[~mask] == 0) and np.all(np_of(ret)[~mask] == 0)


def test_gae_float32_and_bool_mask():
    rng = np.random.default_rng(1)
    mask = make_mask(rng, 5, 16, "mixed")
    rewards, values = rng.normal(size=(5, 16)), rng.normal(size=(5, 16))
    adv, ret = compute_gae(
        t(rewards, torch.float32),
        t(values, torch.float32),
        torch.from_numpy(mask),
        gamma=0.99,
        lam=0.9,
    )
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    ref_adv, ref_ret = ref_gae(rewards, values, mask, 0.99, 0.9)
    np.testing.assert_allclose(np_of(adv), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np_of(ret), ref_ret, rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_valid_outputs():
    """The same trajectory, compact or scattered between padding, gets the same advantages."""
    rng = np.random.default_rng(2)
    rewards, values = rng.normal(size=(1, 6)), rng.normal(size=(1, 6))
    compact, _ = compute_gae(t(rewards), t(values), torch.ones(1, 6), gamma=0.95, lam=0.9)
    positions = np.array([1, 2, 5, 6, 8, 11])
    padded_r, padded_v = np.full((1, 12), 7.0), np.full((1, 12), -3.0)
    padded_r[0, positions], padded_v[0, positions] = rewards[0], values[0]
    mask = np.zeros((1, 12), dtype=bool)
    mask[0, positions] = True
    padded, _ = compute_gae(t(padded_r), t(padded_v), t(mask), gamma=0.95, lam=0.9)
    np.testing.assert_allclose(np_of(padded)[0, positions], np_of(compact)[0], atol=ATOL64)


def test_empty_row_and_terminal_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # Row 0 ends at index 1: returns are plain reward-to-go, V after the end is 0.
    assert ret.tolist() == [[3.0, 2.0, 0.0], [0.0, 0.0, 0.0]]
    assert adv.tolist() == [[2.5, 1.75, 0.0], [0.0, 0.0, 0.0]]


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="shapes"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)


@pytest.mark.parametrize("rows", [0, 2])
def test_no_tokens_at_all_gives_empty_advantages(rows):
    """A rank's shard of a group with fewer samples than ranks has no token axis."""
    from pipeline.algorithms import compute_vtrace, place_on_last_token

    z, mask = torch.zeros(rows, 0), torch.zeros(rows, 0, dtype=torch.bool)
    assert place_on_last_token(torch.ones(rows), mask).shape == (rows, 0)
    for adv, ret in (
        compute_gae(z, z, mask, gamma=1.0, lam=0.9),
        compute_vtrace(z, z, z, z, mask, gamma=1.0, lam=0.9, rho_bar=1.0, c_bar=1.0),
    ):
        assert adv.shape == ret.shape == (rows, 0)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.5)])
def test_gae_over_many_blocks_matches_numpy_reference(kind, gamma, lam):
    """Responses longer than the recursion's block (64 tokens): the sum carried across
    blocks, and decays whose powers underflow over the sequence."""
    rng = rng_for("long", kind, gamma, lam)
    mask = make_mask(rng, 4, 1500, kind)
    rewards, values = rng.normal(size=(4, 1500)), rng.normal(size=(4, 1500))
    adv, ret = compute_gae(
        t(poison(rewards, mask)), t(poison(values, mask)), t(mask), gamma=gamma, lam=lam
    )
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np_of(adv), ref_adv, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(np_of(ret), ref_ret, rtol=1e-12, atol=1e-9)
