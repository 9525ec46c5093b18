"""The typed prompt record every loader produces and the rollout service consumes."""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.errors import PipelineError


class DataError(PipelineError):
    """A dataset file cannot be used: missing, unreadable, or of an unknown format."""


class BadRowError(DataError):
    """One row of a dataset breaks the schema; the message names the file, the row and the fix."""

    def __init__(self, path: str, row: int, problem: str) -> None:
        super().__init__(f"{path}: row {row}: {problem}")
        self.path = path
        self.row = row
        self.problem = problem


class PromptRecord(msgspec.Struct, frozen=True):
    """One prompt with what is needed to score its completions.

    `prompt_text` is exactly what the policy is conditioned on (chat template already applied
    when one was requested); `messages` keeps the original chat turns for re-templating.
    """

    uid: str
    prompt_text: str
    messages: list[dict[str, str]] | None = None
    data_source: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] = msgspec.field(default_factory=dict)
    # this prompt's response budget in tokens; 0: the run's rollout.max_new_tokens
    max_new_tokens: int = 0
    # the tokenizer's end-of-sequence token does not end this prompt's samples, only their
    # budget (or an environment's stop) does: every sample the same length (benchmarks)
    ignore_eos: bool = False
