"""Metric sums kept on-device during a step and reduced across ranks in one collective.

Adding detached tensors (not floats) avoids a host sync per micro-batch; the key set is
fixed up front because ranks must all-reduce identical vectors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from pipeline.training.distributed import all_reduce_, collective_device, is_distributed


class MetricSums:
    """Named running sums (reduced with SUM) and maxima (reduced with MAX)."""

    def __init__(
        self,
        sum_keys: Iterable[str],
        max_keys: Iterable[str] = (),
        device: torch.device | None = None,
    ) -> None:
        """`device`: where a single process accumulates (no host sync per add on a GPU);
        under a process group the backend's device is used."""
        self.sum_keys = sorted(set(sum_keys))
        self.max_keys = sorted(set(max_keys))
        if device is None or is_distributed():
            device = collective_device()
        self._sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in self.sum_keys}
        self._maxes = {
            k: torch.full((), -torch.inf, dtype=torch.float64, device=device) for k in self.max_keys
        }

    def add(self, key: str, value: Tensor | float) -> None:
        if key not in self._sums:
            raise KeyError(f"metric {key!r} was not declared; declared: {self.sum_keys}")
        self._sums[key] += torch.as_tensor(value).detach().to(self._sums[key])

    def max(self, key: str, value: Tensor | float) -> None:
        if key not in self._maxes:
            raise KeyError(f"metric {key!r} was not declared as a max; declared: {self.max_keys}")
        v = torch.as_tensor(value).detach().to(self._maxes[key])
        self._maxes[key] = torch.maximum(self._maxes[key], v)

    def reduce(self) -> dict[str, float]:
        """Global values (sum over ranks / max over ranks) as floats: one or two collectives."""
        out: dict[str, float] = {}
        if self.sum_keys:
            vec = all_reduce_(torch.stack([self._sums[k] for k in self.sum_keys]), "sum")
            out.update(zip(self.sum_keys, vec.tolist(), strict=True))
        if self.max_keys:
            vec = all_reduce_(torch.stack([self._maxes[k] for k in self.max_keys]), "max")
            out.update(zip(self.max_keys, vec.tolist(), strict=True))
        return out
