"""Advantage post-processing: whitening, and group baselines for critic-free training."""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.algorithms.masking import masked_mean, masked_var


def masked_whiten(
    values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(x - mean) / std over the valid tokens of the whole batch; 0 where masked.

    Whitening makes the policy step size independent of the reward scale. With
    `shift_mean=False` the mean is added back, so the sign of each advantage is kept (as verl).
    The variance is Bessel-corrected like verl's masked_whiten.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)  # (batch, seq)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def _check_group_inputs(scores: Tensor, group_ids: Tensor, mask: Tensor) -> None:
    if scores.dim() != 1 or group_ids.shape != scores.shape or mask.shape[:1] != scores.shape:
        raise ValueError(
            "expected scores (batch,), group_ids (batch,) and mask (batch, seq); got "
            f"{tuple(scores.shape)}, {tuple(group_ids.shape)}, {tuple(mask.shape)}"
        )


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Group index per sequence (batch,), and size and mean per group (groups,)."""
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sizes = counts.to(scores.dtype)  # (groups,)
    sums = scores.new_zeros(sizes.shape[0]).index_add_(0, group, scores)  # (groups,)
    return group, sizes, sums / sizes


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO: (score - group mean) / (group std + eps), broadcast onto valid tokens (batch, seq).

    Sequences answering the same prompt share a `group_ids` value; groups may differ in size
    and need not be contiguous. The std is the unbiased one (as verl). A group of one has no
    baseline to compare with, so its advantage is 0 (verl instead passes the raw score on).
    """
    _check_group_inputs(scores, group_ids, mask)
    group, sizes, means = _group_stats(scores, group_ids)
    adv = scores - means[group]  # (batch,)
    if norm_by_std:
        sq = torch.zeros_like(sizes).index_add_(0, group, adv.square())  # (groups,)
        std = torch.sqrt(sq / (sizes - 1).clamp_min(1))  # (groups,) unbiased; 0 for size 1
        adv = adv / (std[group] + eps)
    return torch.where(mask.bool(), adv.unsqueeze(1), 0.0)


@torch.no_grad()
def rloo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """RLOO: score minus the mean of the *other* scores in its group, on valid tokens.

    Leaving the sample out keeps the baseline independent of it, so the estimate is unbiased;
    s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean). A group of one gets 0.
    """
    _check_group_inputs(scores, group_ids, mask)
    group, sizes, means = _group_stats(scores, group_ids)
    n = sizes[group]  # (batch,) size of each sequence's group
    adv = torch.where(n > 1, (scores - means[group]) * n / (n - 1).clamp_min(1), 0.0)  # (batch,)
    return torch.where(mask.bool(), adv.unsqueeze(1), 0.0)
