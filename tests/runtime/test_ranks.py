"""The ranks of one sharded trainer service: world-size checks, the torchrun launch, and
rank 0's commands reaching the other ranks (2 gloo ranks on CPU, torchrun-style env)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pipeline.config import load_config
from pipeline.errors import RankGroupBroken, RankMismatch, WeightSyncError
from pipeline.runtime import ranks
from pipeline.runtime.service import Service, ServiceContext, context_command, follow
from pipeline.runtime.supervisor import launcher_args
from pipeline.wire.messages import RankCommand, RankOp
from pipeline.wire.samples import GroupArrays, SampleArrays

from ..training._helpers import free_port, save_tiny_model

REPO = Path(__file__).resolve().parents[2]
WORLD = 2


def _config(**overrides: str) -> Any:
    return load_config(str(REPO / "profiles/local-cpu.toml"), dict(overrides))


def test_world_size_must_be_the_profiles_fsdp_size():
    sharded = _config(**{"services.learner.fsdp_size": "2"})
    ranks.check_world(sharded, "learner", 2)
    ranks.check_world(_config(), "learner", 1)
    with pytest.raises(RankMismatch, match=r"torchrun --nproc-per-node 2 -m services.learner"):
        ranks.check_world(sharded, "learner", 1)
    with pytest.raises(
        RankMismatch, match=r"started 3 ranks .*fsdp_size = 2; .*learner.fsdp_size 3$"
    ):
        ranks.check_world(sharded, "learner", 3)
    with pytest.raises(RankMismatch, match="a rollout replica is one process here"):
        ranks.check_world(sharded, "rollout", 2)
    with pytest.raises(RankMismatch, match="a reward replica is one process here"):
        ranks.check_world(sharded, "reward", 2)


def test_a_tp_engine_replica_is_tp_ranks_of_the_built_in_engine():
    tp = _config(**{"services.rollout.tp": "2"})
    ranks.check_world(tp, "rollout", 2)
    assert launcher_args(tp, "rollout")[:3] == [
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
    ]
    with pytest.raises(RankMismatch, match=r"services.rollout.tp = 2 needs 2 ranks"):
        ranks.check_world(tp, "rollout", 1)
    # vLLM starts its own TP workers: one process
    vllm = _config(**{"services.rollout.tp": "2", "rollout.engine": "vllm"})
    assert vllm.ranks_per_replica("rollout") == 1
    assert launcher_args(vllm, "rollout") == ["services.rollout"]


def test_a_missing_world_size_means_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ranks.launched_ranks() == 1
    assert ranks.join(_config(), "learner", 0) is None
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(Exception, match="WORLD_SIZE='two' must be an integer"):
        ranks.launched_ranks()


def test_pipeline_run_starts_a_sharded_trainer_under_torchrun():
    config = _config(**{"services.learner.fsdp_size": "2"})
    assert launcher_args(config, "learner") == [
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "services.learner",
    ]
    assert launcher_args(config, "rollout") == ["services.rollout"]
    assert launcher_args(_config(), "learner") == ["services.learner"]


def _groups(seed: int = 0, sizes: tuple[int, ...] = (3, 2, 1)) -> list[GroupArrays]:
    """Sample groups as they reach the learner or critic (tiny-model vocabulary)."""
    g = np.random.default_rng(seed)
    groups = []
    for k, size in enumerate(sizes):
        samples = []
        for i in range(size):
            n = int(g.integers(1, 7))
            samples.append(
                SampleArrays(
                    uid=f"p{k}/{i}",
                    response_ids=g.integers(0, 64, n).astype(np.int32),
                    behaviour_logprobs=(-4.0 + 0.3 * g.standard_normal(n)).astype(np.float32),
                    token_versions=np.zeros(n, np.int32),
                    score=float(g.random()),
                    extra={"ref_logprobs": (-4.0 + g.standard_normal(n)).astype(np.float32)},
                )
            )
        prompt = g.integers(0, 64, int(g.integers(2, 6))).astype(np.int32)
        groups.append(GroupArrays(uid=f"p{k}", prompt_ids=prompt, samples=samples))
    return groups


def _same_groups(a: list[GroupArrays], b: list[GroupArrays]) -> bool:
    for ga, gb in zip(a, b, strict=True):
        if ga.uid != gb.uid or not np.array_equal(ga.prompt_ids, gb.prompt_ids):
            return False
        for sa, sb in zip(ga.samples, gb.samples, strict=True):
            if (sa.uid, sa.score) != (sb.uid, sb.score) or sa.extra.keys() != sb.extra.keys():
                return False
            for name in ("response_ids", "behaviour_logprobs", "token_versions"):
                if not np.array_equal(getattr(sa, name), getattr(sb, name)):
                    return False
            if not all(np.array_equal(sa.extra[k], sb.extra[k]) for k in sa.extra):
                return False
    return True


def test_groups_cross_to_the_other_ranks_exactly():
    groups = _groups()
    assert _same_groups(ranks.decode_groups(ranks.encode_groups(groups)), groups)


# -------------------------------------------------------------------- 2 gloo ranks


def _join(rank: int, port: int, role: str = "learner", config: Any = None) -> ranks.RankLink:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    config = config or _config(**{f"services.{role}.fsdp_size": str(WORLD)})
    link = ranks.join(config, role, 0)
    assert link is not None and (link.rank, link.world) == (rank, WORLD)
    return link


class _Recorder:
    """A follower that writes down what it was told to run."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.seen: list[dict[str, Any]] = []

    def execute(self, command: RankCommand) -> None:
        groups = ranks.decode_groups(command.groups)
        self.seen.append(
            {
                "op": RankOp(command.op).name,
                "step": command.step,
                "version": command.version,
                "same_groups": _same_groups(groups, _groups()) if groups else None,
            }
        )
        record = {
            "run_id": self.ctx.run_id,
            "run_name": self.ctx.config.run.name,
            "policy_version": self.ctx.policy_version,
            "seen": self.seen,
        }
        (self.ctx.run_dir / "follower.json").write_text(json.dumps(record))


class _RecordingService(Service):
    role = "learner"

    @classmethod
    def follower(cls, ctx: ServiceContext) -> _Recorder:
        return _Recorder(ctx)


def _rank0_context(link: ranks.RankLink, out_dir: str) -> ServiceContext:
    config = _config(**{"services.learner.fsdp_size": str(WORLD), "run.name": "sharded"})
    return ServiceContext(
        config=config,
        role="learner",
        replica=0,
        run_id="run-7",
        run_dir=Path(out_dir),
        policy_version=5,
        ranks=link,
    )


def _plumbing_worker(rank: int, port: int, out_dir: str) -> None:
    link = _join(rank, port)
    result: dict[str, Any] = {}
    if rank == 0:
        ctx = _rank0_context(link, out_dir)
        link.lead(context_command(ctx), lambda: None)
        step = RankCommand(op=RankOp.TRAIN, step=3, groups=ranks.encode_groups(_groups()))
        result["train"] = link.lead(step, lambda: "trained")

        def sync_fails() -> None:
            raise WeightSyncError("buckets", "rollout-0", "gone")

        try:
            link.lead(
                RankCommand(op=RankOp.PUBLISH, version=4), sync_fails, agreed=(WeightSyncError,)
            )
        except WeightSyncError:
            result["agreed_error_keeps_the_group"] = not link.broken
        link.stop()
        link.stop()  # idempotent: one STOP
        try:
            link.lead(RankCommand(op=RankOp.TRAIN, step=4), lambda: None)
        except RankGroupBroken as exc:
            result["after_stop"] = str(exc)
    else:
        result["released"] = follow(_RecordingService, ranks=link, replica=0, grace_s=60)
    link.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # c10d's threads can abort a normal interpreter exit


def test_rank0_commands_reach_the_other_rank_in_order_until_stop(tmp_path):
    mp.spawn(_plumbing_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    leader = json.loads((tmp_path / "rank0.json").read_text())
    assert leader["train"] == "trained"
    assert leader["agreed_error_keeps_the_group"] is True
    assert "stopped" in leader["after_stop"]
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"released": True}
    follower = json.loads((tmp_path / "follower.json").read_text())
    # the run's context as rank 0 got it from the controller
    assert follower["run_id"] == "run-7" and follower["run_name"] == "sharded"
    assert follower["policy_version"] == 5
    assert follower["seen"] == [
        {"op": "TRAIN", "step": 3, "version": 0, "same_groups": True},
        {"op": "PUBLISH", "step": 0, "version": 4, "same_groups": None},
    ]


def _broken_worker(rank: int, port: int, out_dir: str) -> None:
    link = _join(rank, port)
    if rank == 0:
        link.lead(context_command(_rank0_context(link, out_dir)), lambda: None)

        def step_fails() -> None:
            raise RuntimeError("a collective failed halfway")

        with_error = ""
        try:
            link.lead(RankCommand(op=RankOp.TRAIN, step=0), step_fails)
        except RuntimeError:
            try:
                link.lead(RankCommand(op=RankOp.TRAIN, step=1), lambda: None)
            except RankGroupBroken as exc:
                with_error = str(exc)
        link.stop()  # sends nothing: the other rank may be stuck in the failed collective
        Path(out_dir, "rank0.json").write_text(json.dumps({"error": with_error}))
        os._exit(0)  # gone without a barrier (0 only so that mp.spawn waits for rank 1)
    start = time.monotonic()
    try:
        follow(_RecordingService, ranks=link, replica=0, grace_s=60)
        outcome = "released"
    except Exception as exc:
        outcome = type(exc).__name__
    seconds = time.monotonic() - start
    Path(out_dir, "rank1.json").write_text(json.dumps({"outcome": outcome, "seconds": seconds}))
    os._exit(0)


def test_a_rank0_that_fails_in_a_collective_sends_nothing_more_and_its_follower_fails_fast(
    tmp_path,
):
    ctx = mp.spawn(_broken_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    while not ctx.join(timeout=60):
        pass
    leader = json.loads((tmp_path / "rank0.json").read_text())
    assert "broken by a failed collective" in leader["error"]
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert follower["outcome"] != "released"  # rank 0's process is gone: gloo says so
    assert follower["seconds"] < 30
    seen = json.loads((tmp_path / "follower.json").read_text())["seen"]
    assert [s["op"] for s in seen] == ["TRAIN"]


# -------------------------------------------------------- the critic's sharded work


def _critic_config(model_dir: str, **overrides: str) -> Any:
    return load_config(
        str(REPO / "profiles/local-cpu-ppo.toml"),
        {
            "model.path": model_dir,
            "controller.prompts_per_step": "2",
            **overrides,
        },
    )


def _annotations(groups: list[GroupArrays]) -> dict[str, np.ndarray]:
    return {
        f"{s.uid}:{name}": s.extra[name]
        for g in groups
        for s in g.samples
        for name in ("values", "advantages", "returns")
    }


def _critic_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from services.critic.service import CriticService
    from services.critic.worker import CriticWorker

    config = _critic_config(model_dir, **{"services.critic.fsdp_size": str(WORLD)})
    link = _join(rank, port, "critic", config)
    if rank == 0:
        ctx = ServiceContext(
            config=config, role="critic", replica=0, run_id="r", run_dir=Path(out_dir), ranks=link
        )
        link.lead(context_command(ctx), lambda: None)
        worker = CriticWorker(ctx)
        groups = _groups(seed=1)

        async def annotate_all() -> None:
            thread = ranks.TrainerThread("critic", link)
            await thread.run(worker.build, -1, command=RankCommand(op=RankOp.SETUP, step=-1))
            for group in groups:  # the third comes after a value update on the first two
                command = RankCommand(op=RankOp.ANNOTATE, groups=ranks.encode_groups([group]))
                await thread.run(worker.annotate, [group], command=command)
            thread.close()

        asyncio.run(annotate_all())
        np.savez(Path(out_dir, "sharded.npz"), **_annotations(groups))
        Path(out_dir, "steps.json").write_text(json.dumps(worker.steps))
        link.stop()
    else:
        assert follow(CriticService, ranks=link, replica=0, grace_s=60)
    link.close()
    os._exit(0)


def test_a_sharded_critic_annotates_like_one_process(tmp_path):
    """2 ranks, each on its strided shard of a group (the 1-sample group leaves rank 1
    empty), the shards summed back into the whole group; the third group comes after a
    sharded value update. Same values, advantages and returns as one process."""
    model_dir = str(save_tiny_model(tmp_path / "model"))
    from services.critic.worker import CriticWorker

    single = CriticWorker(
        SimpleNamespace(config=_critic_config(model_dir), run_dir=tmp_path, ranks=None)
    )
    single.build(-1)
    expected_groups = _groups(seed=1)
    for group in expected_groups:
        single.annotate([group])
    expected = _annotations(expected_groups)

    mp.spawn(_critic_worker, args=(free_port(), model_dir, str(tmp_path)), nprocs=WORLD, join=True)
    assert json.loads((tmp_path / "steps.json").read_text()) == single.steps == 1
    got = dict(np.load(tmp_path / "sharded.npz"))
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    late = [k for k in expected if k.startswith("p2/") and k.endswith(":values")]
    assert late and np.abs(expected[late[0]]).sum() > 0


async def test_trainer_calls_all_run_on_one_thread_off_the_loop():
    """CUDA graph trees belong to the thread that recorded them: every call of a worker's
    trainer must land on the same thread, whatever else used the default pool meanwhile."""
    thread = ranks.TrainerThread("test-trainer")
    loop_thread = threading.get_ident()
    seen = []
    for _ in range(6):
        # other work on the loop's default pool keeps several of its threads busy and idle
        others = [asyncio.to_thread(threading.get_ident) for _ in range(4)]
        seen.append(await thread.run(threading.get_ident))
        await asyncio.gather(*others)
    thread.close()
    assert len(set(seen)) == 1 and seen[0] != loop_thread
