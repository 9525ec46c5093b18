"""Rollout engines: one interface, three backends (built-in torch, transformers, vLLM)."""

from pipeline.engines.base import Engine
from pipeline.engines.errors import (
    BackendUnavailableError,
    EngineError,
    EngineStateError,
    InvalidRequestError,
    WeightUpdateError,
)
from pipeline.engines.factory import EngineKind, make_engine
from pipeline.engines.torch_engine import TorchEngine, TorchEngineConfig
from pipeline.engines.types import (
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)

__all__ = [
    "BackendUnavailableError",
    "Engine",
    "EngineError",
    "EngineKind",
    "EngineStateError",
    "FinishReason",
    "GenerationOutput",
    "GenerationRequest",
    "InvalidRequestError",
    "SamplingParams",
    "TorchEngine",
    "TorchEngineConfig",
    "WeightUpdateError",
    "make_engine",
]
