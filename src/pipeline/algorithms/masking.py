"""Masked reductions shared by every estimator and loss.

Padded positions may hold garbage (NaN from a padded logit row, -inf log-probs), so they are
selected away with `torch.where` rather than multiplied by zero, which would keep NaN alive.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_same_shape(**tensors: Tensor) -> None:
    """Fail early with the names of mismatched inputs; broadcasting would hide the bug."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    # compared, not hashed: a set of symbolic sizes would pin each to its value (a compiled
    # caller then recompiles for every new batch size)
    first = next(iter(shapes.values()), ())
    if any(shape != first for shape in shapes.values()):
        detail = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"expected equal (batch, seq) shapes, got {detail}")
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ValueError(f"expected {name} of shape (batch, seq), got {shape}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over valid positions; a float mask acts as per-token weights."""
    weighted = torch.where(mask.bool(), x * mask.to(x.dtype), 0.0)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Weighted mean over valid positions; 0 (not NaN) where nothing is valid."""
    weights = mask.to(x.dtype)
    total = weights.sum() if dim is None else weights.sum(dim=dim)
    # An empty mask gives 0 / tiny = 0, so an all-padding micro-batch contributes nothing.
    return masked_sum(x, mask, dim) / total.clamp_min(torch.finfo(x.dtype).tiny)


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance over all valid positions (Bessel-corrected by default, as verl's masked_var)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        # With a single valid token the correction is undefined; the biased value (0) is kept.
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(torch.finfo(x.dtype).tiny), var)
    return var


def last_valid_index(mask: Tensor) -> Tensor:
    """Index of the last valid token per row, shape (batch,); seq-1 for rows with none."""
    seq = mask.shape[-1]
    flipped = torch.flip(mask.bool(), dims=[-1]).to(torch.float32)  # (batch, seq)
    return seq - 1 - torch.argmax(flipped, dim=-1)


def place_on_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """Spread per-sequence scores (batch,) onto (batch, seq), on the last valid token only.

    Rows without a valid token drop their score: there is no token to credit.
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"expected scores of shape ({mask.shape[0]},), got {tuple(scores.shape)}")
    out = scores.new_zeros(mask.shape)  # (batch, seq)
    if mask.shape[-1] == 0:  # no tokens at all (e.g. a rank's empty shard of a small group)
        return out
    out.scatter_(1, last_valid_index(mask).unsqueeze(1), scores.unsqueeze(1))
    return torch.where(mask.bool(), out, 0.0)
