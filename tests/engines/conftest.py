"""A tiny random llama saved as a local HF checkpoint, loaded by every engine under test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.engines import TorchEngine, TorchEngineConfig
from pipeline.models import save_model

from .helpers import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    save_model(make_model(), path)
    return path


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def make_torch_engine(
    model_dir: Path, request: pytest.FixtureRequest
) -> Callable[..., TorchEngine]:
    """Engines with finished flags read at once (sync) and one step late (overlap, the CUDA
    default): every behaviour tested holds in both."""

    def make(**options) -> TorchEngine:
        options.setdefault("max_seq_len", 128)
        options.setdefault("overlap", request.param)
        return TorchEngine.from_pretrained(model_dir, config=TorchEngineConfig(**options))

    return make
