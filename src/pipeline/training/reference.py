"""The frozen reference policy: the initial weights' log-probs of each response, for the KL
terms (the learner's KL loss, the critic's KL-shaped reward).

One class serves every host: the reference service, and the critic or learner process
that keeps it beside its own model (`reference.host`). Under a process group it is
sharded like the trainer's model, so every rank must call `logprobs` on its shard.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from pipeline.models import CausalLM
from pipeline.models.hf_causal import HFModule, load_for_training
from pipeline.training.batch import ExperienceBatch
from pipeline.training.config import TrainerConfig
from pipeline.training.distributed import DistInfo, current_dist_info
from pipeline.training.engine import place_model
from pipeline.training.forward import response_logprobs
from pipeline.training.transformers_path import for_transformers


class ReferencePolicy:
    """A causal LM with no gradients, stored in the compute dtype (sharded when
    distributed)."""

    def __init__(
        self,
        model: str | os.PathLike[str] | CausalLM,
        config: TrainerConfig,
        *,
        dist: DistInfo | None = None,
    ) -> None:
        self.config = config
        self.info = dist or current_dist_info(config.device)
        if not isinstance(model, torch.nn.Module):
            model = load_for_training(  # type: ignore[assignment]
                model, implementation=config.implementation, role="reference"
            )
        if isinstance(model, HFModule):
            self.config = for_transformers(config)
        self.model: CausalLM = place_model(model, self.config, self.info, trainable=False)  # type: ignore[assignment, arg-type]

    def warm_up(self, batches: list[ExperienceBatch]) -> float:
        """Compile what its forward runs on each batch; the seconds it took."""
        import time

        start = time.perf_counter()
        for batch in batches:
            self.logprobs(batch)
        return time.perf_counter() - start

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> Tensor:
        """Reference log-probs of the response tokens, (n, R) float32, 0 where masked."""
        return response_logprobs(self.model, batch, self.config, self.info.device)
