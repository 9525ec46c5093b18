"""When a trainer service saves a checkpoint: every `every_steps` updates and every
`every_s` seconds since its last save, whichever comes first (0 turns either off), so a
crash loses at most that much training."""

from __future__ import annotations

import time
from collections.abc import Callable


class CheckpointClock:
    def __init__(
        self, every_steps: int, every_s: float, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_steps = every_steps
        self.every_s = every_s
        self._now = now
        self._last = now()
        self.saved_count: int | None = None  # updates the last checkpoint holds

    def due(self, count: int) -> bool:
        """Whether to save after `count` updates."""
        by_steps = self.every_steps > 0 and count % self.every_steps == 0
        by_time = self.every_s > 0 and self._now() - self._last >= self.every_s
        return by_steps or by_time

    def saved(self, count: int) -> None:
        self._last = self._now()
        self.saved_count = count
