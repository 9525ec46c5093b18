"""Metric sums kept on-device during a step and reduced across ranks in one collective.

Adding detached tensors (not floats) avoids a host sync per micro-batch; host values
(Python numbers, CPU tensors) are summed on the host and join the device sums only in
`reduce`, so no add ever waits for the device. The key set is fixed up front because ranks
must all-reduce identical vectors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.training.distributed import all_reduce_, collective_device, is_distributed
from pipeline.training.transfer import to_device


@dataclass(frozen=True)
class MetricVector:
    """Values of named sums as one (len(keys),) tensor: added to MetricSums in one op."""

    keys: tuple[str, ...]
    values: Tensor


Metrics = Mapping[str, Tensor | float] | MetricVector
_INDICES: dict[tuple[tuple[str, ...], tuple[str, ...], torch.device], Tensor] = {}


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
        # one vector per kind (two fills, not one per key); a device add goes to its entry
        self._sum_vec = torch.zeros(len(self.sum_keys), dtype=torch.float64, device=device)
        self._max_vec = torch.full(
            (len(self.max_keys),), -torch.inf, dtype=torch.float64, device=device
        )
        self._sums = {k: i for i, k in enumerate(self.sum_keys)}
        self._maxes = {k: i for i, k in enumerate(self.max_keys)}
        self._host_sums = dict.fromkeys(self.sum_keys, 0.0)
        self._host_maxes = dict.fromkeys(self.max_keys, -math.inf)

    def _on_device(self, value: Tensor | float) -> bool:
        return isinstance(value, Tensor) and value.device.type != "cpu"

    def add(self, key: str, value: Tensor | float) -> None:
        if key not in self._sums:
            raise KeyError(f"metric {key!r} was not declared; declared: {self.sum_keys}")
        if self._on_device(value):
            view = self._sum_vec[self._sums[key]]
            view += value.detach().to(view)  # type: ignore[union-attr]
        else:
            self._host_sums[key] += float(value)

    def add_all(self, metrics: Metrics, scale: float = 1.0) -> None:
        """Add every value times `scale`; a MetricVector on the device in one index_add."""
        if not isinstance(metrics, MetricVector):
            for key, value in metrics.items():
                self.add(key, value * scale)
            return
        missing = [k for k in metrics.keys if k not in self._sums]
        if missing:
            raise KeyError(f"metrics {missing} were not declared; declared: {self.sum_keys}")
        if not self._on_device(metrics.values):
            for key, value in zip(metrics.keys, metrics.values.tolist(), strict=True):
                self._host_sums[key] += value * scale
            return
        index = self._index(metrics.keys)
        values = metrics.values.detach().to(self._sum_vec.dtype)
        self._sum_vec.index_add_(0, index, values, alpha=scale)

    def _index(self, keys: tuple[str, ...]) -> Tensor:
        """The positions of `keys` in the device vector (made once per declared key set,
        key tuple and device: a step's sums are made anew each step)."""
        at = (tuple(self.sum_keys), keys, self._sum_vec.device)
        index = _INDICES.get(at)
        if index is None:
            host = torch.tensor([self._sums[k] for k in keys], dtype=torch.int64)
            index = _INDICES[at] = to_device(host, self._sum_vec.device)
        return index

    def max(self, key: str, value: Tensor | float) -> None:
        if key not in self._maxes:
            raise KeyError(f"metric {key!r} was not declared as a max; declared: {self.max_keys}")
        if self._on_device(value):
            view = self._max_vec[self._maxes[key]]
            torch.maximum(view, value.detach().to(view), out=view)  # type: ignore[union-attr]
        else:
            self._host_maxes[key] = max(self._host_maxes[key], float(value))

    def reduce(self) -> dict[str, float]:
        """Global values (sum over ranks / max over ranks) as floats: one collective per
        kind, and one read of the device."""
        return self.reduce_with([])[0]

    def reduce_with(self, extra: Sequence[Tensor]) -> tuple[dict[str, float], list[float]]:
        """`reduce`, and the values of this rank's `extra` device scalars (not reduced)
        from the same read of the device."""
        keys, vector = self.stage_with(extra)
        return split_values(keys, vector.tolist())

    def stage_with(self, extra: Sequence[Tensor]) -> tuple[list[str], Tensor]:
        """The global values of `reduce_with` as one float64 vector still on the device
        (the keys name its head, `extra` fills its tail): queued, not read."""
        sums = self._sum_vec + self._host_vector(self._host_sums, self.sum_keys)
        maxes = torch.maximum(self._max_vec, self._host_vector(self._host_maxes, self.max_keys))
        if self.sum_keys:  # no-ops without a process group
            sums = all_reduce_(sums, "sum")
        if self.max_keys:
            maxes = all_reduce_(maxes, "max")
        tail = [t.detach().reshape(1).to(sums) for t in extra]
        return [*self.sum_keys, *self.max_keys], torch.cat([sums, maxes, *tail])

    def _host_vector(self, values: dict[str, float], keys: list[str]) -> Tensor:
        host = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        return to_device(host, self._sum_vec.device)


def split_values(keys: list[str], values: list[float]) -> tuple[dict[str, float], list[float]]:
    """A staged vector's values as (the named head by key, the tail)."""
    return dict(zip(keys, values[: len(keys)], strict=True)), values[len(keys) :]
