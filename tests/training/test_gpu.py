"""CUDA paths: bf16 compute with float32 master weights on one GPU (autocast) and FSDP2 over
NCCL with bf16 params and float32 gradient reduction on two GPUs."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import (
    CriticTrainer,
    PolicyTrainer,
    TrainerConfig,
    init_distributed,
    teardown_distributed,
)

from ._helpers import free_port, make_batch, save_tiny_model, state_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ALGORITHM = AlgorithmConfig(use_kl_loss=True, entropy_coef=0.01)


@pytest.mark.gpu
@needs_cuda
def test_single_gpu_bf16_step_keeps_fp32_masters_and_tracks_cpu_logprobs(tmp_path: Path):
    model_dir = save_tiny_model(tmp_path / "model")
    config = TrainerConfig(lr=1e-3, device="cuda", max_tokens_per_micro_batch=32, mini_batches=2)
    trainer = PolicyTrainer(model_dir, config, ALGORITHM)
    assert trainer.model.lm_head.weight.dtype == torch.float32
    batch = make_batch(seed=0)
    cpu = PolicyTrainer(model_dir, config.replace(device="cpu"), ALGORITHM)
    torch.testing.assert_close(
        trainer.compute_logprobs(batch), cpu.compute_logprobs(batch), atol=0.1, rtol=0.05
    )
    metrics = trainer.train_step(batch)
    assert metrics["actor/skipped_updates"] == 0
    assert all(math.isfinite(v) for v in metrics.values())
    critic = CriticTrainer(model_dir, config, AlgorithmConfig())
    scored, _ = critic.compute_advantages(make_batch(seed=1, advantages=False))
    assert math.isfinite(critic.train_step(scored)["critic/value_loss"])
    trainer.save_checkpoint(tmp_path / "ckpt")
    fresh = PolicyTrainer(model_dir, config, ALGORITHM)
    fresh.load_checkpoint(tmp_path / "ckpt")
    for name, value in state_of(fresh.model).items():
        assert torch.equal(value, state_of(trainer.model)[name]), name


def _fsdp_worker(rank: int, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    info = init_distributed(device="cuda")
    try:
        out = Path(root)
        config = TrainerConfig(
            device="cuda", lr=1e-3, mini_batches=2, max_tokens_per_micro_batch=24
        )
        trainer = PolicyTrainer(out / "model", config, ALGORITHM)
        assert info.device.type == "cuda" and torch.distributed.get_backend() == "nccl"
        for step in range(2):
            metrics = trainer.train_step(make_batch(seed=step, n=9).shard(rank, 2))
            assert metrics["actor/skipped_updates"] == 0, metrics
        trainer.save_checkpoint(out / "ckpt")
        fresh = PolicyTrainer(out / "model", config, ALGORITHM)
        fresh.load_checkpoint(out / "ckpt")
        a, b = state_of(trainer.model), state_of(fresh.model)
        assert all(torch.equal(a[n], b[n]) for n in a)
        trainer.export_hf(out / "export")
    finally:
        teardown_distributed()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_fsdp_nccl_bf16_steps_checkpoint_and_export(tmp_path: Path):
    from pipeline.models import load_model

    save_tiny_model(tmp_path / "model")
    mp.spawn(_fsdp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert load_model(tmp_path / "export").config.vocab_size == 64
