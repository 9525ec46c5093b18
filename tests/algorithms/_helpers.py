"""Random masked inputs and float64 NumPy references shared by the algorithm tests.

The references loop over each sample's valid indices in plain NumPy; they never call the
code under test.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

SHAPES = [(1, 1), (3, 7), (6, 20)]
MASK_KINDS = ["right", "left", "holes", "mixed"]
ATOL64 = 1e-10
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def rng_for(*parts: object) -> np.random.Generator:
    """A generator seeded from the test's parameters, stable across processes."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def make_mask(rng: np.random.Generator, batch: int, seq: int, kind: str) -> np.ndarray:
    """(batch, seq) bool with at least one valid token per row, padded as `kind` says."""
    mask = np.zeros((batch, seq), dtype=bool)
    for b in range(batch):
        n = int(rng.integers(1, seq + 1))
        if kind == "right":
            mask[b, :n] = True
        elif kind == "left":
            mask[b, seq - n :] = True
        elif kind == "holes":
            mask[b] = rng.random(seq) < 0.6
        elif kind == "mixed":
            start = int(rng.integers(0, seq - n + 1))
            mask[b, start : start + n] = rng.random(n) < 0.75
        else:
            raise AssertionError(kind)
        if not mask[b].any():
            mask[b, int(rng.integers(0, seq))] = True
    return mask


def poison(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """NaN in every masked position: any leak of padding into a result shows up."""
    return np.where(mask, x, np.nan)


def t(x: np.ndarray, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def np_of(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float64).numpy()


def ref_gae(rewards, values, mask, gamma, lam):
    """Direct sums: A_s = sum_l (gamma lam)^l delta_{s+l} over the compacted valid tokens."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for b in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[b])
        r, v = rewards[b, idx], values[b, idx]
        v_next = np.append(v[1:], 0.0)
        delta = r + gamma * v_next - v
        for k in range(len(idx)):
            adv[b, idx[k]] = sum((gamma * lam) ** (j - k) * delta[j] for j in range(k, len(idx)))
    returns = np.where(mask, adv + values, 0.0)
    return adv, returns


def ref_agg(loss, mask, mode):
    """verl's agg_loss over valid tokens; sequences without tokens leave seq-means."""
    if mode == "token-mean":
        return sum(loss[mask]) / mask.sum()
    per_seq = []
    for b in range(loss.shape[0]):
        vals = loss[b, mask[b]]
        if len(vals) == 0:
            continue
        per_seq.append(vals.sum() if mode == "seq-mean-token-sum" else vals.mean())
    return float(np.mean(per_seq)) if per_seq else 0.0
