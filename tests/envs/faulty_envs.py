"""Environments that misbehave on request, for the environment pool's and the rollout's tests.

`FaultyEnv` does what its episode's prompt text (in `reset`) or the action (in `step`) says:
raise, hang, return garbage, exit the worker; any other action is echoed back with the
episode's uid and turn, so a test sees which instance answered. Loaded by the pool's worker
as `tests.envs.faulty_envs:FaultyEnv` or as a file path spec.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any, ClassVar

from pipeline.envs.toy_lookup import LookupEnv
from pipeline.envs.types import Environment, Episode, StepResult

NOT_A_CLASS = 3


class FaultyEnv(Environment):
    stop: ClassVar[tuple[str, ...]] = ("?",)

    def __init__(
        self,
        log: str = "",
        greet: bool = True,
        hang_on: str = "",
        raise_on: str = "",
        done_after: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.log = log  # a file that gets one line per close, when given
        self.greet = greet  # reset says hello
        self.hang_on, self.raise_on = hang_on, raise_on  # also hang / raise on this action
        self.done_after = done_after  # done at this turn (0: only on the action "done")
        self.uid = ""
        self.turns = 0

    def reset(self, episode: Episode) -> Any:
        self.uid = episode.uid
        if episode.prompt_text == "raise":
            raise RuntimeError("reset failed on purpose")
        if episode.prompt_text == "hang":
            time.sleep(3600)
        if episode.prompt_text == "garbage":
            return 7  # not a str
        return f"hello {episode.uid}" if self.greet else ""

    def step(self, action: str) -> Any:
        if action == "raise" or (self.raise_on and action == self.raise_on):
            raise ValueError("step failed on purpose")
        if action == "hang" or (self.hang_on and action == self.hang_on):
            time.sleep(3600)
        if action == "garbage":
            return {"observation": "a dict, not a StepResult"}
        if action == "bad types":
            return StepResult(observation=12)  # type: ignore[arg-type]
        if action == "bad flag":
            return StepResult(done=1)  # type: ignore[arg-type]
        if action == "nan":
            return StepResult(reward=float("nan"))
        if action == "surrogate":
            return StepResult(observation="half a pair: \ud800")
        if action == "raise surrogate":
            raise ValueError("half a pair: \ud800")
        if action == "exit":
            raise SystemExit(3)
        if action == "die":
            os._exit(3)
        if action == "pid":
            return StepResult(observation=str(os.getpid()))
        self.turns += 1
        done = action == "done" or self.turns == self.done_after
        return StepResult(observation=f" {self.uid}:{self.turns}:{action}", reward=1.0, done=done)

    def close(self, cancelled: bool) -> None:
        if self.log:
            with Path(self.log).open("a") as f:
                f.write(f"{self.uid} {cancelled}\n")


class AsyncEnv(Environment):
    """Coroutine methods: the worker awaits them, other episodes' calls beside them. The
    action "wait X" awaits X seconds, "hang" awaits for good, "block" holds the worker's
    loop for good (a plain sleep in a coroutine)."""

    async def reset(self, episode: Episode) -> str:  # type: ignore[override]
        await asyncio.sleep(0.01)
        return "async hello"

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        if action.startswith("wait "):
            await asyncio.sleep(float(action.split()[1]))
        if action == "hang":
            await asyncio.sleep(3600)
        if action == "block":
            time.sleep(3600)
        if action == "pid":
            return StepResult(observation=str(os.getpid()))
        await asyncio.sleep(0.01)
        return StepResult(observation=action.upper(), done=True, reward=0.5)


class FlakyLookupEnv(LookupEnv):
    """The toy lookup task's environment, failing some episodes for good, picked by a hash
    of their uid (the same in every run of a seed): one in `every` raises in reset, one
    returns no text from reset, one raises in step, one returns garbage from step. The
    first sample of prompts whose uid starts with `hang_prefix` hangs in reset. `slow_s`:
    every call takes that long (episodes stay in flight)."""

    def __init__(
        self, every: int = 12, hang_prefix: str = "", slow_s: float = 0.0, **options: Any
    ) -> None:
        super().__init__(**options)
        self.every, self.hang_prefix, self.slow_s = every, hang_prefix, slow_s
        self.bucket = -1

    def reset(self, episode: Episode) -> Any:
        time.sleep(self.slow_s)
        digest = int.from_bytes(hashlib.blake2b(episode.uid.encode(), digest_size=4).digest())
        uid = episode.uid
        if self.hang_prefix and uid.startswith(self.hang_prefix) and uid.endswith("/0"):
            time.sleep(3600)
        self.bucket = digest % self.every
        if self.bucket == 0:
            raise RuntimeError(f"flaky reset of {episode.uid}")
        if self.bucket == 1:
            return None
        return super().reset(episode)

    def step(self, action: str) -> Any:
        time.sleep(self.slow_s)
        if self.bucket == 2:
            raise RuntimeError("flaky step")
        if self.bucket == 3:
            return "garbage"
        return super().step(action)
