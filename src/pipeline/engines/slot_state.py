"""Per-slot device tensors of the built-in engine: tokens, log-probs, versions, parameters.

Everything the decode loop reads or writes lives here, indexed by slot, so a step gathers the
running rows with one index tensor instead of assembling Python lists. Token columns are
absolute positions in the sequence (prompt then generated tokens); one extra column absorbs
the padding of batched prompt writes.
"""

from __future__ import annotations

import torch


class SlotState:
    """Buffers for num_slots sequences of up to max_seq_len + 1 tokens."""

    def __init__(self, num_slots: int, max_seq_len: int, device: torch.device) -> None:
        self.device = device
        self.sink = max_seq_len + 1  # column for padding writes, never read
        cols = max_seq_len + 2
        self.tokens = torch.zeros(num_slots, cols, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(num_slots, cols, dtype=torch.float32, device=device)
        self.versions = torch.zeros(num_slots, cols, dtype=torch.int32, device=device)
        self.length = torch.zeros(num_slots, dtype=torch.long, device=device)  # tokens so far
        self.prompt_len = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.max_new = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.keys = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.done = torch.zeros(num_slots, dtype=torch.bool, device=device)  # finished rows
        # policy version of the weights in use (the engine sets it when it applies weights)
        self.version = torch.zeros((), dtype=torch.int32, device=device)
        self.stop_ids = torch.full((num_slots, 1), -1, dtype=torch.long, device=device)

    def ensure_stop_width(self, width: int) -> None:
        """Widen the padded stop-id table (padding -1 never matches a token)."""
        if width > self.stop_ids.shape[1]:
            pad = torch.full(
                (self.stop_ids.shape[0], width - self.stop_ids.shape[1]),
                -1,
                dtype=torch.long,
                device=self.device,
            )
            self.stop_ids = torch.cat([self.stop_ids, pad], dim=1)
