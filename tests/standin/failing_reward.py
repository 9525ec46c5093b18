"""A verifier that is down: every call raises."""

from __future__ import annotations

from typing import Any


def reward_fn(data_source: str, solution: str, ground_truth: str, extra: Any = None) -> float:
    raise RuntimeError("the verifier is down")
