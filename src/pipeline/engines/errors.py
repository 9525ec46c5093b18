"""Typed errors of the generation engines; each message says how to fix the problem."""

from __future__ import annotations

from pipeline.errors import PipelineError


class EngineError(PipelineError):
    """Base of the errors raised by a generation engine."""


class InvalidRequestError(EngineError):
    """A request or its sampling parameters cannot be served (bad values, duplicate id,
    prompt longer than the engine's max_seq_len)."""


class EngineStateError(EngineError):
    """The call does not fit the engine's state (e.g. generate() while paused)."""


class WeightUpdateError(EngineError):
    """A weight update names unknown parameters, has wrong shapes or goes back in version;
    it is refused before the engine takes any of it, so the previous weights keep serving."""


class BackendUnavailableError(EngineError):
    """The optional package a backend needs (vllm, transformers) is not installed."""
