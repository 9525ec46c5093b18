"""The toy tool task's environment (`pipeline.tasks.toy_lookup`): a lookup tool called by `?`."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any, ClassVar

from pipeline.envs.types import Environment, Episode, StepResult

CALL = "?"


class LookupEnv(Environment):
    """A turn that is exactly `?` calls the tool, which answers " <value> ="; a turn that ends
    in `?` after other text is a malformed call (a tool error). Any other turn is the final
    answer: reward 1 when it is the value, else 0. More than `max_calls` calls are errors.

    `tool_delay_s` > 0: every tool call waits before it answers, as a remote tool would, for
    a time drawn from a lognormal of that median and `tool_delay_sigma`, seeded by
    `tool_delay_seed` and the episode's uid (the same waits in every run of a seed). The wait
    is awaited: the worker serves other episodes meanwhile."""

    stop: ClassVar[tuple[str, ...]] = (CALL,)

    def __init__(
        self,
        max_calls: int = 2,
        tool_delay_s: float = 0.0,
        tool_delay_sigma: float = 0.8,
        tool_delay_seed: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if tool_delay_s < 0 or tool_delay_sigma < 0:
            raise ValueError("tool_delay_s and tool_delay_sigma must be >= 0")
        self.max_calls = max_calls
        self.tool_delay_s, self.tool_delay_sigma = tool_delay_s, tool_delay_sigma
        self.tool_delay_seed = tool_delay_seed
        self.calls = 0
        self.value = ""
        self.rng = random.Random(tool_delay_seed)

    def reset(self, episode: Episode) -> str:
        self.value = episode.ground_truth.strip()
        self.rng = random.Random(f"{self.tool_delay_seed}:{episode.uid}")
        return ""

    def delay_s(self) -> float:
        """The next call's wait in seconds (0 without a delay)."""
        if self.tool_delay_s <= 0:
            return 0.0
        return self.rng.lognormvariate(math.log(self.tool_delay_s), self.tool_delay_sigma)

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        if not action.endswith(CALL):
            reward = 1.0 if action.strip() == self.value else 0.0
            return StepResult(reward=reward, done=True)
        self.calls += 1
        if delay := self.delay_s():
            await asyncio.sleep(delay)
        if action != CALL or self.calls > self.max_calls:
            return StepResult(observation=" no =", tool_call=True, tool_error=True)
        return StepResult(observation=f" {self.value} =", tool_call=True)
