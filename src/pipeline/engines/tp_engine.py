"""One engine replica over `tp` processes: the leader (TP rank 0) is the engine the rollout
service drives; each follower runs the same engine on its shard of the model, in lockstep.

Every rank runs the same scheduling: the leader sends each step's inputs (the requests
added since the last step, whether to apply a weight update and which version, pause) to
the followers in one broadcast on a CPU (gloo) group, and every rank then steps. Their
model forwards meet in the TP collectives (models/tensor_parallel.py), their logits are
gathered whole, and sampling noise is a hash of (seed, token index, vocab id): every rank
draws the same tokens, so only the leader's outputs are returned.

Weights: each rank's receiver parks that rank's shards (`ModelWeights` over its sharded
parameters). The leader decides when an update is applied (the version parked on it at a
step's start); a follower applies that version at the same step, waiting for its own
shards of it if they are not parked yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.engines.base import Engine
from pipeline.engines.errors import EngineStateError, WeightUpdateError
from pipeline.engines.torch_engine import TorchEngine
from pipeline.engines.types import GenerationOutput, GenerationRequest
from pipeline.engines.weights import ModelWeights


@dataclass
class _Step:
    """What every rank needs to take one step exactly as the leader does."""

    requests: list[GenerationRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # sessions ended before this step
    apply: int | None = None  # the weight version to apply at this step
    paused: bool = False
    stop: bool = False


class GatedWeights(ModelWeights):
    """A rank's parked weights, applied only at the step and version the leader chose."""

    def __init__(self, model: torch.nn.Module, *, wait_s: float) -> None:
        super().__init__(model)
        self.due: int | None = None
        self.wait_s = wait_s

    def parked_version(self) -> int | None:
        parked = self._parked
        if parked is None or parked.future.cancelled():
            return None
        return parked.version

    def has_pending(self) -> bool:
        return self.due is not None

    def apply(self) -> int | None:
        due, self.due = self.due, None
        if due is None:
            return None
        deadline = time.monotonic() + self.wait_s
        while self.parked_version() != due:
            parked = self.parked_version()
            if (parked is not None and parked > due) or time.monotonic() > deadline:
                raise WeightUpdateError(
                    f"TP rank holds weight version {parked}, the leader applies {due}: the "
                    "ranks of one replica got different updates (a receiver timed out?)"
                )
            time.sleep(0.001)
        return super().apply()


class TPEngine(Engine):
    """A `TorchEngine` on one TP rank, stepped in lockstep with the other ranks."""

    def __init__(
        self, engine: TorchEngine, *, rank: int, control: Any = None, weights_wait_s: float = 600
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.control = control  # gloo group of the replica's ranks (None: the default group)
        self.weights = GatedWeights(engine.model, wait_s=weights_wait_s)
        self.weights._version = engine.weights.version
        engine.weights = self.weights
        self._added: list[GenerationRequest] = []
        self._released: list[str] = []
        self._stopped = False

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- Engine interface (leader) ---------------------------------------------------------

    @property
    def version(self) -> int:
        return self.engine.version

    def has_unfinished(self) -> bool:
        return bool(self._added) or self.engine.has_unfinished()

    def add_request(self, request: GenerationRequest) -> None:
        self._check_leader("add_request")
        self.engine.add_request(request)  # refused here, before any follower sees it
        self._added.append(request)

    def release(self, session: str) -> None:
        self._check_leader("release")
        self._released.append(session)  # every rank frees the slot at the same step

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        checked: bool = False,
    ) -> Future[int]:
        """This rank's shards of `version` (every rank's receiver calls it)."""
        return self.weights.update(named_tensors, version, checked=checked)

    def step(self) -> list[GenerationOutput]:
        self._check_leader("step")
        self.weights.due = self.weights.parked_version()
        plan = _Step(self._added, self._released, self.weights.due, self.paused)
        self._added, self._released = [], []
        self._broadcast(plan)
        return self._take(plan, local_requests=False)

    def close(self) -> None:
        if self.leader and not self._stopped:
            self._stopped = True
            self._broadcast(_Step(stop=True))
        self.engine.close()

    # -- followers -------------------------------------------------------------------------

    def follow(self) -> None:
        """A follower's loop: take each step the leader sends until it says stop."""
        if self.leader:
            raise EngineStateError("the TP leader drives the engine; only followers follow")
        while True:
            plan = self._broadcast(None)
            if plan.stop:
                self.engine.close()
                return
            self.weights.due = plan.apply
            self._take(plan, local_requests=True)

    # -- internals -------------------------------------------------------------------------

    def _take(self, plan: _Step, *, local_requests: bool) -> list[GenerationOutput]:
        for session in plan.released:
            self.engine.release(session)
        if local_requests:
            for request in plan.requests:
                self.engine.add_request(request)
        self.engine._paused = plan.paused
        return self.engine.step()

    def _broadcast(self, plan: _Step | None) -> _Step:
        box: list[Any] = [plan]
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.control)
        return box[0]

    def _leader_rank(self) -> int:
        if self.control is None:
            return 0
        return dist.get_global_rank(self.control, 0)

    def _check_leader(self, what: str) -> None:
        if not self.leader:
            raise EngineStateError(f"{what} on TP rank {self.rank}: only the leader is driven")
