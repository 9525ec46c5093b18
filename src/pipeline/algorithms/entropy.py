"""Token entropy from logits and the entropy bonus term of the actor loss."""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.algorithms.aggregation import LossAggMode, agg_loss
from pipeline.algorithms.masking import check_same_shape


def _entropy_rows(logits: Tensor) -> Tensor:
    """Entropy of each row of (n, vocab) logits, stable for huge and -inf logits."""
    log_probs = torch.log_softmax(logits, dim=-1)  # (n, vocab)
    probs = log_probs.exp()  # (n, vocab)
    # Banned tokens (-inf logits) have p = 0 and log p = -inf: their term must be 0, not NaN.
    # log p is replaced *before* the product, or the backward pass still computes 0 * -inf.
    safe_log_probs = torch.where(probs > 0, log_probs, 0.0)  # (n, vocab)
    return -(probs * safe_log_probs).sum(dim=-1)  # (n,)


def token_entropy(logits: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Entropy per position of logits (..., vocab), returned with shape (...).

    A full-vocab softmax of a long batch costs as much memory as the logits themselves;
    `chunk_size` bounds that temporary to `chunk_size` rows at a time. Half-precision logits
    are upcast to float32 (a bf16 entropy is too coarse to log or to optimise).
    """
    if logits.dim() < 1:
        raise ValueError("expected logits of shape (..., vocab)")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 or None, got {chunk_size}")
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    leading = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])  # (n, vocab)
    step = rows.shape[0] if chunk_size is None else chunk_size
    chunks = [
        _entropy_rows(rows[start : start + step].to(compute_dtype))
        for start in range(0, rows.shape[0], max(step, 1))
    ]
    if not chunks:
        return rows.new_zeros(leading, dtype=compute_dtype)
    return torch.cat(chunks).reshape(leading)


def entropy_bonus_loss(
    entropy: Tensor,
    mask: Tensor,
    *,
    coef: float,
    loss_agg_mode: LossAggMode = "token-mean",
) -> Tensor:
    """The term to *add* to the actor loss: -coef * agg(entropy), so minimising it raises entropy."""
    check_same_shape(entropy=entropy, mask=mask)
    return -coef * agg_loss(entropy, mask, loss_agg_mode)
