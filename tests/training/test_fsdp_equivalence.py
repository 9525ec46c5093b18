"""2-rank FSDP2 (gloo, CPU, joined from torchrun-style env) learner steps equal
single-process steps on the whole batch, with and without trainer.fused_norm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import (
    PolicyTrainer,
    TrainerConfig,
    build_mesh,
    group_advantages,
    init_distributed,
    teardown_distributed,
)
from pipeline.training.micro_batching import plan_micro_batches, split_mini_batches

from ._helpers import free_port, make_batch, save_tiny_model, state_of

WORLD = 2
STEPS = 2
SAMPLES = 9  # odd: the ranks hold 5 and 4 samples
# float32 params and reductions: sharding only changes summation order
ATOL = 1e-6
RTOL = 1e-5
K_BIAS_ATOL = 1e-4  # = 0.1 * lr

CONFIG = TrainerConfig(
    device="cpu",
    lr=1e-3,
    schedule="cosine",
    warmup_steps=1,
    total_steps=10,
    ppo_epochs=2,
    mini_batches=2,
    # small budget: ranks need different micro-batch counts (one runs a dummy) and some
    # sequences exceed it
    max_tokens_per_micro_batch=12,
    infer_max_tokens_per_micro_batch=40,
    grad_clip=1.0,
    # every step scores the previous version's tokens with its kept weights (swapped into
    # the sharded parameters in place): the lagged check's figure must match too
    mismatch_check_every=1,
)
ALGORITHM = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
COMPARED = (
    "actor/pg_loss",
    "actor/loss",
    "actor/kl_loss",
    "actor/entropy",
    "kl/k3",
    "mismatch/kl",
    "mismatch/same_version_kl",
)


def _worker(rank: int, port: int, model_dir: str, out_dir: str, fused_norm: bool) -> None:
    torch.set_num_threads(1)
    # torchrun-style environment, as the learner service gets it
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    info = init_distributed(device="cpu")
    try:
        assert (info.rank, info.world_size, dist.get_backend()) == (rank, WORLD, "gloo")
        mesh = build_mesh(info)
        assert mesh is not None and mesh.size() == WORLD
        trainer = PolicyTrainer(model_dir, CONFIG.replace(fused_norm=fused_norm), ALGORITHM)
        history = []
        for step in range(STEPS):
            shard = make_batch(seed=step, n=SAMPLES).shard(rank, WORLD)
            # the batch's tokens are of version 0: step 1 measures them by the lagged check
            history.append(trainer.submit_step(shard, version=step).result())
        # critic-free advantages: groups split across ranks get whole-batch baselines
        for estimator in ("grpo", "rloo"):
            algorithm = AlgorithmConfig(advantage_estimator=estimator)
            whole = make_batch(seed=5, n=SAMPLES, group_size=3, advantages=False)
            local = group_advantages(whole.shard(rank, WORLD), algorithm).advantages
            expected = group_advantages(whole, algorithm, across_ranks=False)
            expected = expected.shard(rank, WORLD).advantages
            # gathered in rank order: group sums differ from the whole batch's in round-off
            torch.testing.assert_close(local, expected, atol=1e-5, rtol=1e-5)
            assert local.abs().sum() > 0, estimator
        state = state_of(trainer.model)
        if rank == 0:
            torch.save(state, Path(out_dir) / "state.pt")
            (Path(out_dir) / "metrics.json").write_text(json.dumps(history))
    finally:
        teardown_distributed()
        assert not dist.is_initialized()
    # reached only on success: skip interpreter teardown, where c10d's threads can abort
    # the exit ("terminate called without an active exception") after the work passed
    os._exit(0)


def _micro_counts(rank: int, seed: int) -> list[int]:
    shard = make_batch(seed=seed, n=SAMPLES).shard(rank, WORLD)
    lengths = shard.seq_lengths
    minis = split_mini_batches(range(shard.num_samples), CONFIG.mini_batches)
    budget = CONFIG.max_tokens_per_micro_batch
    return [len(plan_micro_batches([lengths[i] for i in m], budget)) for m in minis]


# fused_norm: every residual add inside the next norm's op (its torch formula on CPU), whose
# weights FSDP's hooks must have gathered when the op reads them
@pytest.mark.parametrize("fused_norm", [False, True])
def test_two_rank_fsdp_steps_equal_single_process_steps_weights_and_losses(
    tmp_path: Path, fused_norm: bool
):
    # precondition: the ranks disagree on micro-batch counts, so the sync path is exercised
    assert _micro_counts(0, 0) != _micro_counts(1, 0)
    model_dir = save_tiny_model(tmp_path / "model")
    single = PolicyTrainer(model_dir, CONFIG.replace(fused_norm=fused_norm), ALGORITHM)
    expected = [
        single.submit_step(make_batch(seed=step, n=SAMPLES), version=step).result()
        for step in range(STEPS)
    ]
    expected_state = state_of(single.model)

    args = (free_port(), str(model_dir), str(tmp_path), fused_norm)
    mp.spawn(_worker, args=args, nprocs=WORLD, join=True)

    state = torch.load(tmp_path / "state.pt")
    assert sorted(state) == sorted(expected_state)
    initial = state_of(PolicyTrainer(model_dir, CONFIG, AlgorithmConfig()).model)
    moved = [n for n in state if not torch.equal(expected_state[n], initial[n])]
    assert len(moved) == len(state), "every parameter should have been updated"
    for name, value in state.items():
        # k_proj.bias has an exactly-zero true gradient (softmax ignores a per-query shift),
        # so Adam normalises pure round-off into lr-sized steps: only a loose bound holds
        atol = K_BIAS_ATOL if name.endswith("k_proj.bias") else ATOL
        torch.testing.assert_close(value, expected_state[name], atol=atol, rtol=RTOL, msg=name)
    history = json.loads((tmp_path / "metrics.json").read_text())
    for got, want in zip(history, expected, strict=True):
        assert got["actor/updates"] == want["actor/updates"] == 4
        assert got["actor/skipped_updates"] == 0
        for key in COMPARED:
            assert abs(got[key] - want[key]) <= 1e-5 + 1e-4 * abs(want[key]), key
        assert got["perf/tokens"] == want["perf/tokens"]
