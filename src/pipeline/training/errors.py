"""Typed errors of the training library."""

from __future__ import annotations

from pipeline.errors import PipelineError


class TrainingError(PipelineError):
    """A batch or trainer state cannot be trained on; the message says what to fix."""


class BatchError(TrainingError):
    """An ExperienceBatch is malformed (shapes, dtypes, missing fields)."""


class CheckpointStateError(TrainingError):
    """A training checkpoint is missing, incomplete, or was written by an incompatible run."""


class CheckpointDigestError(CheckpointStateError):
    """A checkpoint does not match its digest (or has none): refused before any of it is
    read back, since DCP unpickles its files."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CheckpointError(CheckpointStateError):
    """No checkpoint under a root could be loaded: each one tried, with its reason."""

    def __init__(self, root: str, tried: list[tuple[str, str]]) -> None:
        lines = "; ".join(f"{path}: {reason}" for path, reason in tried)
        super().__init__(f"no checkpoint under {root} loads ({lines})")
        self.root = root
        self.tried = tried
