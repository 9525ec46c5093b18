"""Slot-based, preallocated KV cache for the built-in generation engine.

Convention (shared with `CausalLM.forward_cached`):

* A *slot* is one sequence's row in the cache; the engine assigns slots and reuses them.
* Every input token carries its absolute position in its slot. The token's post-RoPE key and
  value are written at that position and a query at position p attends to positions [0, p] of
  its own slot. Entries beyond p (stale data of an earlier sequence in the slot) are masked.
* Position -1 marks padding (e.g. right-padded prompts in a batched prefill). Padding is
  written to a sink column at index `max_seq_len` that is never read, so writes need no
  boolean filtering (no host sync, no data-dependent shapes). Logits at padded tokens are
  meaningless but finite.

The buffers therefore have `max_seq_len + 1` columns:
k, v: (num_layers, num_slots, max_seq_len + 1, num_kv_heads, head_dim).
"""

from __future__ import annotations

import torch

from pipeline.errors import PipelineError


class CacheCapacityError(PipelineError):
    """A position does not fit in the cache; raise max_seq_len or finish the sequence."""


class KVCache:
    """Preallocated keys/values for `num_slots` sequences of up to `max_seq_len` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        shape = (num_layers, num_slots, max_seq_len + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # decode steps (t = 1) attend with the in-place Triton kernel instead of gather + SDPA;
        # set by the engine where `decode_kernel_supported` says it runs
        self.decode_kernel = False

    @property
    def sink(self) -> int:
        """Column index that absorbs writes of padding tokens (position -1)."""
        return self.max_seq_len

    def write_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Map positions (b, t) to cache columns: padding (-1) goes to the sink column."""
        return torch.where(positions >= 0, positions, torch.full_like(positions, self.sink))

    def kv_len_for(self, positions: torch.Tensor) -> int:
        """Columns to read for these positions (host sync); checks capacity."""
        kv_len = int(positions.max().item()) + 1
        if kv_len > self.max_seq_len:
            raise CacheCapacityError(
                f"position {kv_len - 1} does not fit in a KV cache of max_seq_len="
                f"{self.max_seq_len}"
            )
        return max(kv_len, 1)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        columns: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write k/v (b, t, kv_heads, head_dim) at (slots, columns) of `layer`."""
        rows = slots[:, None].expand_as(columns)  # (b, t)
        self.k[layer].index_put_((rows, columns), k.to(self.k.dtype))
        self.v[layer].index_put_((rows, columns), v.to(self.v.dtype))

    def read(
        self, layer: int, slots: torch.Tensor, kv_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first kv_len columns of `slots` in `layer`, (b, kv_len, kv_heads, head_dim)
        each, as `dtype` (a gathered copy)."""
        k_ctx = self.k[layer, slots, :kv_len]
        v_ctx = self.v[layer, slots, :kv_len]
        return k_ctx.to(dtype), v_ctx.to(dtype)
