"""On a GPU the host never waits for queued device work between train steps: host-device
copies go through pinned memory, and a submitted step returns before the device finishes
it. Each test first queues a kernel that spins ~0.2 s, so that a host wait would find the
stream idle afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import PolicyTrainer, TrainerConfig
from pipeline.training.transfer import HostCopy, to_device

from ._helpers import make_batch, save_tiny_model, state_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _busy_device() -> None:
    """Queue a kernel that spins 4e8 clock cycles (0.2 s at 2 GHz) on the current stream."""
    torch.cuda._sleep(400_000_000)


@pytest.mark.parametrize("numel", [100_000, 1_000_000], ids=["800kB-pageable", "8MB-pinned"])
def test_host_copies_are_queued_behind_busy_work_without_waiting(numel: int):
    host = torch.arange(numel, dtype=torch.int64)
    stream = torch.cuda.current_stream()
    queued = []
    # the first round allocates device and pinned blocks (cudaMalloc and cudaHostAlloc wait
    # for the device); the caching allocators reuse them in the second, a steady state
    for _ in range(2):
        _busy_device()
        moved = to_device(host, torch.device("cuda"))
        back = HostCopy(moved * 2)
        queued.append(not stream.query() and not back.ready())  # behind the busy kernel
        assert torch.equal(back.wait(), host * 2) and back.ready()
    assert queued[1]


def test_a_submitted_step_returns_before_the_device_runs_it(tmp_path: Path):
    model_dir = save_tiny_model(tmp_path / "model")
    config = TrainerConfig(
        lr=1e-3, device="cuda", param_dtype="bfloat16", max_tokens_per_micro_batch=64
    )
    batches = [make_batch(seed=s) for s in (0, 1, 1)]
    blocking = PolicyTrainer(model_dir, config, AlgorithmConfig())
    expected = [blocking.train_step(b) for b in batches]
    trainer = PolicyTrainer(model_dir, config, AlgorithmConfig())
    for batch in batches[:2]:  # warm: first-step setup (optimizer state, the address table,
        trainer.train_step(batch)  # pinned blocks for the metric copy) may wait for the device
    _busy_device()
    pending = trainer.submit_step(batches[2])
    assert not torch.cuda.current_stream().query() and not pending.done()
    metrics = pending.result()
    assert metrics["actor/grad_norm"] == pytest.approx(expected[2]["actor/grad_norm"], rel=1e-4)
    for name, value in state_of(blocking.model).items():
        torch.testing.assert_close(state_of(trainer.model)[name], value, msg=name)
