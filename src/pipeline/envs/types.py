"""What an environment is: the interface a multi-turn task implements.

An environment is a class; the rollout service makes one instance per episode (a sample of
a prompt), in an environment worker process, and drives it turn by turn:

- `reset(episode)` once, before the first turn: the text it returns (may be empty) is
  appended after the prompt as environment tokens;
- `step(action)` after every policy turn, with the turn's text (it ends at the tokenizer's
  end-of-sequence token or at one of the class's `stop` strings): the observation's text is
  appended as environment tokens, `reward` adds to the episode's score, `done` ends it;
- `close(cancelled)` once at the end: `cancelled` is true when the episode was cut short
  (token or turn budget spent, a failed step, the service stopping).

Methods may be plain or `async def`. An instance lives in one worker process, so it may keep
any state it likes between its calls; it is never pickled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, ClassVar

import msgspec

from pipeline.errors import ConfigError
from pipeline.wire.env import Episode

__all__ = ["Environment", "EnvironmentNotFound", "Episode", "StepResult"]


class StepResult(msgspec.Struct):
    """One step's answer. `tool_call` / `tool_error` are counted in the run's metrics."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False


class Environment:
    """Base class of environments (subclassing it is optional; the methods are the API)."""

    # single-token strings that end a policy turn besides end-of-sequence (e.g. a tool
    # call's closing mark)
    stop: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        self.options = options

    def reset(self, episode: Episode) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self, cancelled: bool) -> None:
        return None


class EnvironmentNotFound(ConfigError):
    """An environment name or `module:Class` spec does not resolve to a class."""


def checked_result(value: Any) -> StepResult:
    """`value` if it is a well-formed StepResult; TypeError / ValueError saying why not."""
    if not isinstance(value, StepResult):
        raise TypeError(f"step returned {type(value).__name__}, not a StepResult")
    if not isinstance(value.observation, str):
        raise TypeError(f"observation is {type(value.observation).__name__}, not str")
    if isinstance(value.reward, bool) or not isinstance(value.reward, int | float):
        raise TypeError(f"reward is {type(value.reward).__name__}, not a number")
    if not math.isfinite(value.reward):
        raise ValueError(f"reward is {value.reward}, not finite")
    for name in ("done", "tool_call", "tool_error"):
        if not isinstance(getattr(value, name), bool):
            raise TypeError(f"{name} is {type(getattr(value, name)).__name__}, not bool")
    return value


def field_means(records: Sequence[Any], prefix: str) -> dict[str, float]:
    """Each numeric field of the dataclass `records` as a metric `prefix + name`: its mean
    over the records (one record: its value)."""
    return {
        f"{prefix}{f.name}": sum(float(getattr(r, f.name)) for r in records) / len(records)
        for f in fields(records[0])
    }
