r"""Format reward: credit for answering in the shape the prompt asked for.

A small format bonus early in RL teaches the policy where to put its answer, after which the
correctness reward can see it. The pattern and the scores are configuration, not code: a
caller builds a `FormatReward`, or passes `format_pattern` / `format_score` in `extra_info`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from pipeline.errors import ConfigError

MatchMode = Literal["search", "fullmatch"]

# Default pattern per data source: what "well-formatted" means for that task.
DEFAULT_PATTERNS: dict[str, str] = {
    "gsm8k": r"#### \$?-?[0-9][0-9,]*(?:\.[0-9]+)?",
    "openai/gsm8k": r"#### \$?-?[0-9][0-9,]*(?:\.[0-9]+)?",
    "math": r"\\boxed\{.+\}",
    "toy_reverse": r"\s*[0-9]+\s*",
}
FALLBACK_PATTERN = r"<answer>.+?</answer>"
_FULLMATCH_SOURCES = {"toy_reverse"}


class FormatReward(msgspec.Struct, frozen=True):
    """`score` when the text matches `pattern`, else `penalty`."""

    pattern: str
    score: float = 1.0
    penalty: float = 0.0
    mode: MatchMode = "search"
    dotall: bool = True

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ConfigError(
                f"format reward pattern {self.pattern!r} is not a valid regex: {exc}"
            ) from exc
        if self.mode not in ("search", "fullmatch"):
            raise ConfigError(f"format reward mode {self.mode!r}: use 'search' or 'fullmatch'")

    def __call__(self, solution_str: str) -> float:
        flags = re.DOTALL if self.dotall else 0
        match = (re.search if self.mode == "search" else re.fullmatch)(
            self.pattern, solution_str, flags
        )
        return self.score if match else self.penalty


def reward_for(data_source: str, extra_info: dict[str, Any] | None = None) -> FormatReward:
    """The format rule for a sample: `extra_info` overrides, else the data source's default."""
    info = extra_info or {}
    pattern = info.get("format_pattern") or DEFAULT_PATTERNS.get(data_source, FALLBACK_PATTERN)
    default_mode = "fullmatch" if data_source in _FULLMATCH_SOURCES else "search"
    return FormatReward(
        pattern=pattern,
        score=float(info.get("format_score", 1.0)),
        penalty=float(info.get("format_penalty", 0.0)),
        mode=info.get("format_mode", default_mode),
    )


def reward_fn(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """Registry entry; ignores `ground_truth` on purpose (format only, not correctness)."""
    return reward_for(data_source, extra_info)(solution_str)
