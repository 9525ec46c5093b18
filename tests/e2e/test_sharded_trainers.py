"""`pipeline run` with a learner (and a critic) of 2 FSDP ranks under torchrun, on CPU.

The supervisor starts each sharded trainer as one `torchrun --standalone
--nproc-per-node 2` child; its ranks join one gloo process group, rank 0 serves and rank 1
follows its commands. The run must complete with every uid accounted for exactly once,
both ranks must report the 2-rank group and half the parameters each, and the learner's
reward and loss metrics must reach the controller.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS, PER_STEP, N_SAMPLES = 8, 4, 4


def _run(tmp_path: Path, profile: str, steps: int, *overrides: str) -> Path:
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run",
        "--profile", str(REPO / "profiles" / profile),
        "--name", "sharded", "--no-progress",
        "--run.runs_dir", str(runs),
        "--controller.steps", str(steps),
        "--controller.prompts_per_step", str(PER_STEP),
        "--controller.max_inflight_prompts", str(3 * PER_STEP),
        "--rollout.n_samples", str(N_SAMPLES),
        "--services.reward.replicas", "1",
        "--task.warm_start_steps", "0",
        "--learner.trainer.total_steps", str(steps),
        *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs / "sharded"


def _events(log: Path, name: str) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == name:
                out.append(event)
    return out


def _check_accounting(run: Path, steps: int) -> list[dict]:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == steps
    assert summary["trained"] == summary["released"] - summary["dropped"]
    assert summary["duplicates"] == 0 and summary["in_flight_at_end"] == 0
    schedule = [json.loads(x) for x in (run / "schedule.jsonl").read_text().splitlines()]
    uids = [row["uid"] for row in schedule]
    assert len(uids) == len(set(uids)) == summary["trained"] * N_SAMPLES
    # one torchrun child per sharded trainer, never restarted
    supervisor = json.loads((run / "supervisor.json").read_text())
    assert set(supervisor["restarts"].values()) == {0}
    records = [json.loads(x) for x in (run / "metrics/steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    return records


def _check_sharded(log: Path, role: str) -> None:
    """Both ranks in one 2-rank gloo group, each holding a shard of the model, rank 1
    released by rank 0 at the end and both leaving together."""
    joined = _events(log, "rank_joined")
    assert sorted(e["rank"] for e in joined) == [0, 1], joined
    assert {(e["world_size"], e["backend"], e["service"]) for e in joined} == {(2, "gloo", role)}
    assert len({e["pid"] for e in joined}) == 2
    sharded = _events(log, "model_sharded")
    assert sorted(e["rank"] for e in sharded) == [0, 1]
    total = sharded[0]["params"]
    assert all(e["world_size"] == 2 and 0 < e["local_params"] < total for e in sharded)
    assert sum(e["local_params"] for e in sharded) == total
    assert [e["rank"] for e in _events(log, "released")] == [1]
    assert sorted(e["rank"] for e in _events(log, "rank_left")) == [0, 1]


@pytest.mark.slow
def test_a_learner_of_two_fsdp_ranks_trains_the_run(tmp_path):
    run = _run(
        tmp_path,
        "local-cpu.toml",
        STEPS,
        "--services.learner.fsdp_size", "2",
        "--learner.checkpoint_every", "4",
    )  # fmt: skip
    records = _check_accounting(run, STEPS)
    for r in records:
        assert r["trained"] == PER_STEP * N_SAMPLES
        for key in ("reward_mean", "actor/loss", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(r[key]), key
        assert r["actor/updates"] >= 1 and r["actor/skipped_updates"] == 0
    assert any(r["actor/grad_norm"] > 0 for r in records)
    _check_sharded(run / "logs/learner-0.log", "learner")
    # checkpoints (DCP, collective) and the last save and export
    assert (run / "checkpoints/learner/step_4").is_dir()
    assert (run / "checkpoints/learner/latest").read_text().strip() == f"step_{STEPS}"
    assert (run / "final_model/model.safetensors").exists()
    # the weights went to the engine after every step, from both ranks' gathers
    syncs = _events(run / "logs/learner-0.log", "weight_sync")
    assert {e["version"] for e in syncs if e["rank"] == 0} >= set(range(1, STEPS + 1))
    assert {e["version"] for e in syncs if e["rank"] == 1} >= set(range(1, STEPS + 1))


def test_kl_ppo_with_a_critic_and_a_learner_of_two_fsdp_ranks_each(tmp_path):
    steps = 4
    run = _run(
        tmp_path,
        "local-cpu-ppo.toml",
        steps,
        "--services.learner.fsdp_size", "2",
        "--services.critic.fsdp_size", "2",
    )  # fmt: skip
    records = _check_accounting(run, steps)
    assert all("kl/k3" in r and math.isfinite(r["actor/kl_loss"]) for r in records)
    _check_sharded(run / "logs/learner-0.log", "learner")
    _check_sharded(run / "logs/critic-0.log", "critic")
    # one value update per step's worth of groups, reported once (by rank 0)
    assert [e["rank"] for e in _events(run / "logs/critic-0.log", "critic_step")] == [0] * steps
