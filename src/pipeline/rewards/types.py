"""What goes into and comes out of reward scoring; shared by the scorer and its worker."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

ScoreStatus = Literal["ok", "error", "timeout"]


class ScoreItem(msgspec.Struct, frozen=True):
    """One completion to score, with the dataset fields the reward needs."""

    uid: str
    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict[str, Any] | None = None


class ScoreResult(msgspec.Struct, frozen=True):
    """The score of one item; a failed reward scores 0 and says why in `error`."""

    uid: str
    score: float
    status: ScoreStatus
    error: str | None = None
    elapsed_s: float = 0.0


class ScorerCounters(msgspec.Struct):
    """Running totals since the scorer started; exported as metrics."""

    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    worker_restarts: int = 0


def coerce_score(value: Any) -> float:
    """A reward's return value as a finite float.

    verl-style rewards may return a dict with a `score` key; a NaN or infinite score would
    poison the advantage estimates, so it is an error, not a value.
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward returned a dict without a 'score' key: {sorted(value)}")
        value = value["score"]
    if isinstance(value, str) or not hasattr(value, "__float__"):
        raise TypeError(f"reward returned {type(value).__name__}, expected a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward returned a non-finite score {score!r}")
    return score
