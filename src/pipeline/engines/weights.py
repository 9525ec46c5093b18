"""Staged, versioned weight updates applied in place at a safe point.

update_weights() may run on the weight-receiver thread while the engine thread decodes, so the
update is validated and copied into staging buffers first and published as one unit under a
lock; the engine thread later copies it into the live parameters with param.copy_() (same
storage, so CUDA graphs and the KV cache stay valid). Staging costs one extra copy of the
weights on the model's device until applied.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

from pipeline.engines.errors import WeightUpdateError


class StagedWeights:
    """Holds at most one pending update; a newer one replaces an older one not yet applied."""

    def __init__(self, model: nn.Module, version: int = 0) -> None:
        # keep_vars: the live tensors; a tied lm_head.weight maps to the embedding parameter
        self._targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._version = version
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_version: int | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    @property
    def pending_version(self) -> int | None:
        return self._pending_version

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate and copy a complete update; raises before anything is published."""
        staged: dict[str, torch.Tensor] = {}
        problems: dict[str, list[str]] = {"unknown": [], "duplicate": [], "mis-shaped": []}
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                problems["unknown"].append(name)
            elif name in staged:
                problems["duplicate"].append(name)
            elif tuple(tensor.shape) != tuple(target.shape):
                problems["mis-shaped"].append(
                    f"{name} {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            else:
                staged[name] = tensor.detach().to(
                    device=target.device, dtype=target.dtype, copy=True
                )
        covered = {id(self._targets[name]) for name in staged}
        problems["missing"] = sorted(
            name for name, t in self._targets.items() if id(t) not in covered
        )
        with self._lock:
            floor = max(self._version, self._pending_version or self._version)
            if version < floor:
                problems["stale version"] = [f"{version} < {floor}"]
            if any(problems.values()):
                detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in problems.items() if v)
                raise WeightUpdateError(
                    f"weight update to version {version} refused ({detail}); send every "
                    "parameter of the model once, with its exact shape and a version >= the "
                    "current one"
                )
            self._pending = staged
            self._pending_version = version

    def has_pending(self) -> bool:
        return self._pending_version is not None

    @torch.no_grad()
    def apply(self) -> int | None:
        """Copy the pending update into the live parameters; returns its version or None."""
        with self._lock:
            pending, version = self._pending, self._pending_version
            self._pending, self._pending_version = {}, None
        if version is None:
            return None
        for name, tensor in pending.items():
            self._targets[name].copy_(tensor)
        self._version = version
        return version
