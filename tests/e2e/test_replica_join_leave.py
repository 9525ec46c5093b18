"""A rollout replica joins a running run and later leaves it, as a user would start one on
another host with `pipeline service rollout --replica 1`. It receives the current weights
at once, takes a share of the prompts while it is up, says goodbye to the learner's weight
hub when it stops, and the run completes with every uid accounted for."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS, JOIN_AT = 200, 5
SERVED = 40  # rollout-1 leaves once it has served this many prompts


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _spans(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "metrics" / f"{name}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("kind") == "span" and r.get("name") == "rollout"]


@pytest.mark.slow
def test_a_rollout_replica_joins_and_leaves_a_running_run(tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "joinleave"
    common = [
        "--profile", str(REPO / "profiles/local-cpu.toml"),
        "--run.name", "joinleave", "--run.runs_dir", str(runs),
        "--services.rollout.replicas", "2",
        "--controller.steps", str(STEPS), "--learner.trainer.total_steps", str(STEPS),
        "--task.warm_start_steps", "50",
    ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(role: str, replica: int) -> None:
        name = f"{role}-{replica}"
        cmd = [sys.executable, "-m", "pipeline.cli", "service", role, *common]
        cmd += ["--replica", str(replica)]
        out = (logs / f"{name}.log").open("wb")
        procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def wait_steps(n: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while len(_steps(run_dir)) < n:
            assert procs["controller-0"].poll() is None, "the controller ended early"
            assert time.monotonic() < deadline, f"no step {n} within {timeout}s"
            time.sleep(0.1)

    try:
        start("controller", 0)
        deadline = time.monotonic() + 120
        while not (run_dir / "run.json").exists():
            assert time.monotonic() < deadline and procs["controller-0"].poll() is None
            time.sleep(0.1)
        for role, replica in (("reward", 0), ("reward", 1), ("learner", 0), ("rollout", 0)):
            start(role, replica)
        wait_steps(JOIN_AT)
        joined = time.time()
        version_at_join = _steps(run_dir)[-1]["policy_version"]
        start("rollout", 1)
        deadline = time.monotonic() + 180
        while len(_spans(run_dir, "rollout-1")) < SERVED:
            assert time.monotonic() < deadline, "rollout-1 served nothing"
            assert procs["rollout-1"].poll() is None, "rollout-1 died"
            time.sleep(0.1)
        assert len(_steps(run_dir)) < STEPS - 20, "the run ended before rollout-1 could leave"
        left = time.time()
        procs["rollout-1"].send_signal(signal.SIGTERM)  # a clean leave
        assert procs["rollout-1"].wait(timeout=60) == 0
        assert procs["controller-0"].wait(timeout=300) == 0, "the run did not complete"
    finally:
        for proc in procs.values():  # by pid
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    steps = _steps(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS
    assert summary["duplicates"] == 0 and summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    # it got the current weights right after joining (not the initial ones)
    applied = [
        json.loads(x)
        for x in (logs / "rollout-1.log").read_text().splitlines()
        if x.startswith("{") and '"weight_sync_applied"' in x
    ]
    assert applied and applied[0]["version"] >= version_at_join
    # it generated while it was up, and nothing after it left; replica 0 went on alone
    mine = _spans(run_dir, "rollout-1")
    theirs = _spans(run_dir, "rollout-0")
    assert mine and all(joined <= s["start"] and s["end"] <= left + 5 for s in mine)
    assert any(s["start"] > left + 5 for s in theirs)
    # the learner was told: the next syncs went to replica 0 only, without a timeout stall
    learner_log = (logs / "learner-0.log").read_text()
    assert '"engine_left"' in learner_log
    after = [s for s in steps if s["time"] > left]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(after)]
    assert gaps and max(gaps) < 20, gaps

    def rate(spans: list[dict], lo: float, hi: float) -> float:
        return sum(1 for s in spans if lo <= s["end"] < hi) / max(hi - lo, 1e-9)

    t_end = steps[-1]["time"]
    first = min(s["start"] for s in mine)  # rollout-1 serving (after its model load)
    # prompts served per second by each replica; on 2 shared CPU cores a second replica
    # splits the generation work rather than adding to it (it competes with the learner)
    print(f"\n{'window':<22}{'rollout-0 /s':>14}{'rollout-1 /s':>14}")
    for label, lo, hi in (
        ("one replica (before)", steps[0]["time"], joined),
        ("two replicas", first, left),
        ("one replica (after)", left, t_end),
    ):
        print(f"{label:<22}{rate(theirs, lo, hi):>14.2f}{rate(mine, lo, hi):>14.2f}")
