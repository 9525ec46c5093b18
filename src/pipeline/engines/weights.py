"""Versioned weight updates, taken by the engine thread at a safe point between two steps.

update_weights() may come from another thread (the weight receiver) while the engine thread
decodes. It parks a reference to the caller's tensors, not a copy, and returns a Future; at
its next safe point the engine thread copies them into the live parameters with
param.copy_() (same storage, so CUDA graphs and the KV cache stay valid), serves the new
version and only then resolves the Future. The caller keeps the tensors unchanged until the
Future is done: the receiver's staging tensors are the one staging copy of the weights, and
its WeightDone means the engine serves them. Cancelling the Future (the receiver's apply
timeout) withdraws the update: at the safe point `set_running_or_notify_cancel` skips it
and the old version keeps serving; once the copy has begun, cancel() fails and the caller
waits for the copy to end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.engines.errors import WeightUpdateError

# the engine's own load path: (tensors by name, version) -> None, on the engine thread
LoadFn = Callable[[Mapping[str, torch.Tensor], int], None]


@dataclass(frozen=True)
class _Parked:
    future: Future[int]
    tensors: Mapping[str, torch.Tensor]
    version: int


class SafePoint:
    """At most one parked update; a newer one withdraws an older one not yet applied."""

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self._parked: _Parked | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The version serving now: it changes once the new weights are live."""
        return self._version

    def has_pending(self) -> bool:
        parked = self._parked
        return parked is not None and not parked.future.cancelled()

    def offer(self, tensors: Mapping[str, torch.Tensor], version: int) -> Future[int]:
        """Park a complete update (no copy); resolved with `version` once applied."""
        future: Future[int] = Future()
        with self._lock:
            old = self._parked
            floor = self._version
            if old is not None and not old.future.cancelled():
                floor = max(floor, old.version)
            if version < floor:
                raise WeightUpdateError(
                    f"weight update to version {version} refused (stale version: {version} < "
                    f"{floor}); send a version >= the current one"
                )
            self._parked = _Parked(future, tensors, version)
        if old is not None:
            old.future.cancel()
        return future

    def run(self, load: LoadFn) -> int | None:
        """At a safe point (engine thread): load the parked update, serve its version, then
        resolve its Future. Its version, or None when nothing was parked or it was withdrawn."""
        with self._lock:
            parked, self._parked = self._parked, None
        if parked is None or not parked.future.set_running_or_notify_cancel():
            return None
        try:
            load(parked.tensors, parked.version)
        except BaseException as exc:
            parked.future.set_exception(exc)
            raise
        self._version = parked.version
        parked.future.set_result(parked.version)
        return parked.version


class ModelWeights(SafePoint):
    """A SafePoint that loads into an nn.Module's parameters by name."""

    def __init__(self, model: nn.Module, version: int = 0) -> None:
        super().__init__(version)
        # keep_vars: the live tensors; a tied lm_head.weight maps to the embedding parameter
        self._targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        checked: bool = False,
    ) -> Future[int]:
        """Validate (unless `checked`: the caller already compared names, shapes and dtypes
        with this model's parameters) and park the update; see SafePoint.offer."""
        tensors = dict(named_tensors) if checked else self._validated(named_tensors, version)
        return self.offer(tensors, version)

    def apply(self) -> int | None:
        """At a safe point: copy the parked update into the live parameters."""
        return self.run(self._load)

    def _validated(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        problems: dict[str, list[str]] = {"unknown": [], "duplicate": [], "mis-shaped": []}
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                problems["unknown"].append(name)
            elif name in tensors:
                problems["duplicate"].append(name)
            elif tuple(tensor.shape) != tuple(target.shape):
                problems["mis-shaped"].append(
                    f"{name} {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            else:
                tensors[name] = tensor
        covered = {id(self._targets[name]) for name in tensors}
        problems["missing"] = sorted(
            name for name, t in self._targets.items() if id(t) not in covered
        )
        if any(problems.values()):
            detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in problems.items() if v)
            raise WeightUpdateError(
                f"weight update to version {version} refused ({detail}); send every "
                "parameter of the model once, with its exact shape and a version >= the "
                "current one"
            )
        return tensors

    @torch.no_grad()
    def _load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        # one source per target: a tied lm_head.weight and the embedding share a parameter,
        # and two copies into one tensor inside a foreach kernel would race
        pairs = {id(self._targets[n]): (self._targets[n], t.detach()) for n, t in tensors.items()}
        if not pairs:
            return
        dsts, srcs = zip(*pairs.values(), strict=True)
        torch._foreach_copy_(list(dsts), list(srcs))
        device = dsts[0].device
        if device.type == "cuda":  # resolved means live: the copy has run, not just queued
            torch.cuda.current_stream(device).synchronize()


class ModuleWeightsEngine:
    """`Engine.update_weights` of an engine whose weights are its module's parameters
    (`self.weights`, a ModelWeights)."""

    weights: ModelWeights

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        checked: bool = False,
    ) -> Future[int]:
        return self.weights.update(named_tensors, version, checked=checked)
