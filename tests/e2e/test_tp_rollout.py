"""`services.rollout.tp = 2`: the rollout replica is one torchrun of two engine ranks (gloo
on CPU), each with its shard of the model and its own weight receiver, stepping together."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.e2e.cli_run import cli_run, log_events, step_records


def _run(runs: Path, name: str, *extra: str, steps: int) -> Path:
    return cli_run(runs, name, "--controller.steps", str(steps), *extra)


def _rewards(run: Path) -> list[float]:
    return [s["reward_mean"] for s in step_records(run)]


def test_a_tp2_rollout_replica_serves_a_run_with_every_rank_on_every_version(tmp_path):
    # no warm start of the tiny model: nothing here needs it to learn (~10 s less)
    run = _run(
        tmp_path, "tp2", "--services.rollout.tp", "2", "--task.warm_start_steps", "0", steps=3
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0 and summary["dropped"] == 0
    log = run / "logs/rollout-0.log"
    joined = sorted(e["rank"] for e in log_events(log, "rank_joined"))
    assert joined == [0, 1]
    # each rank's receiver applied each version the learner published, and the follower
    # left when the leader let it go. Every step's version (1..3) is published to both
    # ranks; version 0 (the initial weights, which each rank loads itself) only when the
    # learner's member watch sees an engine register before the first step's sync: on a
    # busy machine the learner may come up after the rollout served the first step's
    # prompts, and then the first publish the engines get is version 1.
    syncs = log_events(run / "logs/learner-0.log", "weight_sync")
    published = {e["version"] for e in syncs if e["event"] == "weight_sync"}
    assert published - {0} == {1, 2, 3}, published
    applied: dict[str, set[int]] = {}
    for e in log_events(log, "weight_sync_applied"):
        applied.setdefault(e["engine"], set()).add(e["version"])
    assert sorted(applied) == ["rollout-0.tp0", "rollout-0.tp1"]
    for versions in applied.values():
        assert versions - {0} == {1, 2, 3} and versions <= published, (applied, published)
    assert [e["rank"] for e in log_events(log, "released")] == [1]


@pytest.mark.slow
def test_a_tp2_run_learns_the_toy_task_like_tp1(tmp_path):
    common = ("--controller.max_staleness", "2")
    one = _rewards(_run(tmp_path, "tp1", *common, steps=80))
    two = _rewards(_run(tmp_path, "tp2", *common, "--services.rollout.tp", "2", steps=80))
    gains = {}
    for name, rewards in (("tp1", one), ("tp2", two)):
        first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
        # as tests/e2e/test_learning.py: 80 of the profile's 500 steps, a clear rise
        assert last > first + 0.05, (name, first, last)
        gains[name] = last
    # other sampling noise (the logits are summed in another order), the same learning
    assert gains["tp2"] > gains["tp1"] - 0.15, gains
