"""Metric sums kept on-device during a step and reduced across ranks in one collective.

Adding detached tensors (not floats) avoids a host sync per micro-batch; host values
(Python numbers, CPU tensors) are summed on the host and join the device sums only in
`reduce`, so no add ever waits for the device. The key set is fixed up front because ranks
must all-reduce identical vectors.
"""

from __future__ import annotations

import math
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
        self._host_sums = dict.fromkeys(self.sum_keys, 0.0)
        self._host_maxes = dict.fromkeys(self.max_keys, -math.inf)

    def _on_device(self, value: Tensor | float) -> bool:
        return isinstance(value, Tensor) and value.device.type != "cpu"

    def add(self, key: str, value: Tensor | float) -> None:
        if key not in self._sums:
            raise KeyError(f"metric {key!r} was not declared; declared: {self.sum_keys}")
        if self._on_device(value):
            self._sums[key] += value.detach().to(self._sums[key])  # type: ignore[union-attr]
        else:
            self._host_sums[key] += float(value)

    def max(self, key: str, value: Tensor | float) -> None:
        if key not in self._maxes:
            raise KeyError(f"metric {key!r} was not declared as a max; declared: {self.max_keys}")
        if self._on_device(value):
            v = value.detach().to(self._maxes[key])  # type: ignore[union-attr]
            self._maxes[key] = torch.maximum(self._maxes[key], v)
        else:
            self._host_maxes[key] = max(self._host_maxes[key], float(value))

    @staticmethod
    def _vectors(device_values: list[Tensor], host_values: list[float]) -> tuple[Tensor, Tensor]:
        """(the device values stacked, the host values on the same device)."""
        vec = torch.stack(device_values)
        host = torch.tensor(host_values, dtype=torch.float64)
        return vec, host.to(vec.device, non_blocking=True)

    def reduce(self) -> dict[str, float]:
        """Global values (sum over ranks / max over ranks) as floats: one or two collectives."""
        out: dict[str, float] = {}
        if self.sum_keys:
            vec, host = self._vectors(
                [self._sums[k] for k in self.sum_keys], [self._host_sums[k] for k in self.sum_keys]
            )
            vec = all_reduce_(vec + host, "sum")
            out.update(zip(self.sum_keys, vec.tolist(), strict=True))
        if self.max_keys:
            vec, host = self._vectors(
                [self._maxes[k] for k in self.max_keys],
                [self._host_maxes[k] for k in self.max_keys],
            )
            vec = all_reduce_(torch.maximum(vec, host), "max")
            out.update(zip(self.max_keys, vec.tolist(), strict=True))
        return out
