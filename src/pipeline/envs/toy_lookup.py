"""The toy tool task's environment (`pipeline.tasks.toy_lookup`): a lookup tool called by `?`."""

from __future__ import annotations

from typing import Any, ClassVar

from pipeline.envs.types import Environment, Episode, StepResult

CALL = "?"


class LookupEnv(Environment):
    """A turn that is exactly `?` calls the tool, which answers " <value> ="; a turn that ends
    in `?` after other text is a malformed call (a tool error). Any other turn is the final
    answer: reward 1 when it is the value, else 0. More than `max_calls` calls are errors."""

    stop: ClassVar[tuple[str, ...]] = (CALL,)

    def __init__(self, max_calls: int = 2, **options: Any) -> None:
        super().__init__(**options)
        self.max_calls = max_calls
        self.calls = 0
        self.value = ""

    def reset(self, episode: Episode) -> str:
        self.value = episode.ground_truth.strip()
        return ""

    def step(self, action: str) -> StepResult:
        if not action.endswith(CALL):
            reward = 1.0 if action.strip() == self.value else 0.0
            return StepResult(reward=reward, done=True)
        self.calls += 1
        if action != CALL or self.calls > self.max_calls:
            return StepResult(observation=" no =", tool_call=True, tool_error=True)
        return StepResult(observation=f" {self.value} =", tool_call=True)
