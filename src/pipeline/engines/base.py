"""The one interface every generation backend implements (built-in torch, transformers, vLLM).

The rollout service drives an engine with add_request / step from one thread; update_weights
may come from another thread (the weight receiver). It only parks a reference to the tensors
and returns a Future; the engine copies them into its live weights at its next safe point
between steps, so a step never sees half of an update, and then resolves the Future.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch

from pipeline.engines.errors import EngineStateError
from pipeline.engines.types import GenerationOutput, GenerationRequest


class Engine(ABC):
    """Continuous-batching generator with versioned, in-flight weight updates."""

    @abstractmethod
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; its params.n samples are admitted independently."""

    @abstractmethod
    def step(self) -> list[GenerationOutput]:
        """Apply a pending weight update if due, admit waiting requests, decode one token for
        every running sample; return the samples that finished in this step."""

    @abstractmethod
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        checked: bool = False,
    ) -> Future[int]:
        """Offer a complete set of weights as policy `version`, applied by a later step().

        The tensors are not copied here: keep them unchanged until the Future is done. It
        resolves once the engine serves `version`; cancel it to withdraw the update (the old
        weights keep serving). A bad update raises WeightUpdateError at once; `checked` skips
        the name and shape checks when the caller already made them (the weight receiver
        validated its metadata against this engine's parameters).
        """

    # every engine pauses the same way: its step() checks this flag
    _paused: bool = False

    def pause(self) -> None:
        """Stop admitting and decoding; a weight update is still applied by step()."""
        self._paused = True

    def resume(self) -> None:
        """Undo pause()."""
        self._paused = False

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version of the weights that the next decoded token will use."""

    @property
    def paused(self) -> bool:
        return self._paused

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any sample is waiting or running."""

    def release(self, session: str) -> None:  # noqa: B027 (engines that keep no sessions)
        """End a session (GenerationRequest.session): free the KV cache kept for it."""

    def close(self) -> None:  # noqa: B027 (optional hook, most engines hold nothing to free)
        """Release backend resources; idempotent."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run `requests` to completion; outputs in request order, then by sample_index.

        Refused while paused (it would never finish) or while other requests are in flight
        (their outputs would be returned to the wrong caller).
        """
        if self.paused:
            raise EngineStateError("engine is paused; call resume() before generate()")
        if self.has_unfinished():
            raise EngineStateError(
                "generate() needs an idle engine; drive in-flight requests with step() first"
            )
        order = {request.request_id: i for i, request in enumerate(requests)}
        for request in requests:
            self.add_request(request)
        outputs: list[GenerationOutput] = []
        while self.has_unfinished():
            outputs.extend(self.step())
        outputs.sort(key=lambda out: (order[out.request_id], out.sample_index))
        return outputs
