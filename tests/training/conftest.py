"""One intra-op thread: the models are tiny, and on a shared 2-core machine OpenMP threads
that spin-wait for each other turn milliseconds into seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
