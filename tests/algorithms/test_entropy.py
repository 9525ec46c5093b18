from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import entropy_bonus_loss, token_entropy

from ._helpers import AGG_MODES, ATOL64, make_mask, np_of, ref_agg, rng_for, t


def ref_entropy(logits):
    """-sum p log p per position, one softmax at a time."""
    out = np.zeros(logits.shape[:-1])
    for i in np.ndindex(out.shape):
        z = logits[i] - np.max(logits[i])
        p = np.exp(z) / np.exp(z).sum()
        nz = p > 0
        out[i] = -np.sum(p[nz] * np.log(p[nz]))
    return out


@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 7, 11), (2, 5, 50)])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_entropy_matches_reference(shape, chunk_size):
    logits = rng_for(shape, chunk_size).normal(scale=3.0, size=shape)
    got = token_entropy(t(logits), chunk_size=chunk_size)
    assert got.shape == shape[:-1]
    np.testing.assert_allclose(np_of(got), ref_entropy(logits), rtol=0, atol=ATOL64)


def test_entropy_is_stable_for_huge_and_banned_logits():
    logits = np.array([[1e4, 1e4 - 1.0, -1e4, 0.0], [3.0, -np.inf, 1.0, -np.inf]])
    got = token_entropy(t(logits))
    np.testing.assert_allclose(np_of(got), ref_entropy(logits), rtol=0, atol=ATOL64)
    x = t(logits).requires_grad_(True)
    token_entropy(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_half_precision_is_upcast_and_gradient_flows_through_chunks():
    rng = rng_for("bf16")
    logits = rng.normal(scale=2.0, size=(2, 6, 32))
    got = token_entropy(t(logits, torch.bfloat16), chunk_size=5)
    assert got.dtype == torch.float32
    bf16_exact = t(logits, torch.bfloat16).double().numpy()
    np.testing.assert_allclose(got.numpy(), ref_entropy(bf16_exact), rtol=1e-5, atol=1e-5)
    x32 = t(logits, torch.float32).requires_grad_(True)
    x64 = t(logits).requires_grad_(True)
    token_entropy(x32, chunk_size=5).sum().backward()
    token_entropy(x64).sum().backward()
    np.testing.assert_allclose(np_of(x32.grad), np_of(x64.grad), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_entropy_bonus_is_negative_scaled_aggregate(mode):
    rng = rng_for("bonus", mode)
    mask = make_mask(rng, 4, 9, "mixed")
    entropy = rng.uniform(0.1, 3.0, size=(4, 9))
    got = entropy_bonus_loss(t(entropy), t(mask), coef=0.01, loss_agg_mode=mode)
    np.testing.assert_allclose(got.item(), -0.01 * ref_agg(entropy, mask, mode), atol=ATOL64)
