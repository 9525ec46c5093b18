"""Critic / reward model: the decoder trunk with a scalar `score` head per token.

The head is HF's `*ForSequenceClassification` score (Linear(hidden, 1, bias=False), named
`score.weight`), so reward-model checkpoints load without renaming; PPO needs a value at
every token, so forward returns (b, s) instead of pooling the last token.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.config import ModelConfig
from pipeline.models.decoder import DecoderBase


class ValueModel(DecoderBase):
    """Per-token scalar values from the shared decoder trunk."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def reset_score(self) -> None:
        """Zero head: a fresh critic predicts 0 everywhere, so early advantages are the
        returns themselves rather than noise from a random projection."""
        nn.init.zeros_(self.score.weight)

    def init_weights(self, std: float = 0.02) -> None:
        super().init_weights(std)
        self.reset_score()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values (b, s) in float32; same padding conventions as CausalLM.forward."""
        hidden = self._dense(input_ids, position_ids, attention_mask)  # (b, s, hidden)
        return self.score(hidden).squeeze(-1).float()

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        uniform: bool = False,
    ) -> torch.Tensor:
        """Values (1, total) for packed sequences (max_seqlen, uniform: see `_packed`)."""
        # (1, total, hidden)
        hidden = self._packed(input_ids, position_ids, cu_seqlens, max_seqlen, uniform)
        return self.score(hidden).squeeze(-1).float()
