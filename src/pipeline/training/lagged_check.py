"""The same-version mismatch at staleness >= 1: the engine's log-probs against the learner's
under the weights that sampled the tokens.

At staleness 0 the learner's current weights sampled the batch, so its proximal forward
measures engine against learner directly. Beyond that most tokens come from the previous
version, and the mismatch against the current weights mixes numerical differences with one
update of drift. Every `trainer.mismatch_check_every` steps the learner therefore keeps a
copy of its weights for one step and, at the next, scores the batch with them: the tokens
that version sampled give the numerical mismatch alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from pipeline.algorithms import kl_k3, masked_sum
from pipeline.training.batch import ExperienceBatch


class LaggedCheck:
    """Keeps the weights of version v (one copy of the parameters) when v + 1 is a check
    step, and scores version v's tokens with them at step v + 1."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._kept: list[Tensor] | None = None
        self._kept_version = -1

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def keep(self, model: nn.Module, version: int) -> None:
        """Before version `version`'s update: copy its weights if the next step checks."""
        if self.due(version + 1):
            with torch.no_grad():
                self._kept = [p.detach().clone() for p in trained(model)]
            self._kept_version = version

    def sums(
        self,
        model: nn.Module,
        batch: ExperienceBatch,
        version: int,
        logprobs: Callable[[], Tensor],
        changed: Callable[[], None],
        *,
        on_policy: bool = False,
    ) -> tuple[Tensor, Tensor] | None:
        """(k3 sum, token count) over the tokens that the kept weights' version sampled,
        or None when this step has no kept weights or, `on_policy`, no token older than
        its own (every rank decides alike). `logprobs` runs the learner's forward over the
        batch (every rank calls it: it may be collective); `changed` tells the trainer
        that its weights were swapped (its low-precision copies go stale)."""
        kept, kept_version = self._kept, self._kept_version
        self._kept = None
        if kept is None or kept_version != version - 1 or on_policy:
            return None
        tokens = batch.response_mask & (batch.token_versions == kept_version)
        with _swapped(model, kept, changed):
            lagged = logprobs()
        k3 = kl_k3(batch.behaviour_logprobs, lagged)
        return masked_sum(k3, tokens), tokens.sum().double()


@contextlib.contextmanager
def _swapped(model: nn.Module, kept: list[Tensor], changed: Callable[[], None]) -> Iterator[None]:
    """The model's parameters hold `kept` inside the block (in place: views, captured graphs
    and optimizer state keep their storage), their own values again after it."""
    params = [p.data for p in trained(model)]
    with torch.no_grad():
        own = [p.clone() for p in params]
        _copy(params, kept)
        changed()
        try:
            yield
        finally:
            _copy(params, own)
            changed()


def _copy(into: list[Tensor], values: list[Tensor]) -> None:
    # one copy_ per tensor: FSDP2's sharded parameters (DTensors) take no foreach copy
    for target, value in zip(into, values, strict=True):
        target.copy_(value)


def trained(model: nn.Module) -> list[Tensor]:
    """The parameters an update changes (a LoRA policy's adapters; every one otherwise)."""
    return [p for p in model.parameters() if p.requires_grad]
