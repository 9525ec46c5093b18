"""Boolean attention masks (True = may attend), shaped (b, 1, q, k) for SDPA.

Every query row keeps at least one allowed key (padding queries may attend to themselves or
to key 0): a fully masked row makes SDPA return NaN, and NaN at a padded position still
poisons gradients through 0 * NaN.
"""

from __future__ import annotations

import torch


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Causal mask that also hides padding keys; attention_mask (b, s) of 1/0."""
    s = attention_mask.shape[1]
    device = attention_mask.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()  # (s, s)
    keys_valid = attention_mask.bool()[:, None, :]  # (b, 1, s)
    eye = torch.eye(s, dtype=torch.bool, device=device)
    allowed = (causal[None] & keys_valid) | eye  # (b, s, s)
    return allowed[:, None]  # (b, 1, s, s)


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Block-diagonal causal mask for sequences packed back to back in one row.

    cu_seqlens (n + 1,) holds the cumulative lengths starting at 0; tokens after
    cu_seqlens[-1] (tail padding) form one extra block of their own.
    """
    device = cu_seqlens.device
    idx = torch.arange(total, device=device)
    seq_id = torch.searchsorted(cu_seqlens[1:].contiguous(), idx, right=True)  # (total,)
    same = seq_id[:, None] == seq_id[None, :]  # (total, total)
    causal = idx[:, None] >= idx[None, :]
    return (same & causal)[None, None]  # (1, 1, total, total)


def cached_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Query at position p sees cache columns [0, p]; padding (p = -1) sees column 0 only."""
    cols = torch.arange(kv_len, device=positions.device)  # (kv_len,)
    allowed = cols[None, None, :] <= positions[:, :, None]  # (b, t, kv_len)
    allowed = allowed | ((positions[:, :, None] < 0) & (cols == 0))
    return allowed[:, None]  # (b, 1, t, kv_len)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, s)
