"""Seconds of a step's phases on its device (reference forward, proximal forward, update),
read once the step has settled: CUDA events in stream order, no synchronisation of their own."""

from __future__ import annotations

import time
from typing import Any

import torch


class PhaseClock:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._start = self._now()
        self._marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if not self._cuda:  # CPU ops run as they are called
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str) -> None:
        """The end of `phase`; it began at the previous mark (or at the clock's start)."""
        self._marks.append((phase, self._now()))

    def seconds(self) -> dict[str, float]:
        """`perf/<phase>_s` per phase marked; waits for the last mark on a GPU."""
        out: dict[str, float] = {}
        if self._cuda and self._marks:
            self._marks[-1][1].synchronize()  # stream order: the earlier marks are done too
        previous = self._start
        for phase, now in self._marks:
            if self._cuda:
                out[f"perf/{phase}_s"] = previous.elapsed_time(now) / 1000.0
            else:
                out[f"perf/{phase}_s"] = now - previous
            previous = now
        return out
