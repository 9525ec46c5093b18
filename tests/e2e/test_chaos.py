"""Chaos: SIGKILL each role in turn during a real run (rollout, reward, critic, learner,
controller); the supervisor restarts it, the run completes, and every released uid is
trained exactly once or counted dropped. The learner checkpoints every step and resumes
from its last checkpoint; the controller resumes from its journal (same run id, the
prompts in flight released again under their uids) and the running services rejoin it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (role, at step)
ROTATION = [("rollout", 4), ("reward", 9), ("critic", 14), ("learner", 19), ("controller", 24)]
STEPS = 30


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` with their command lines (from /proc, by parent pid)."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except (OSError, ValueError):
            continue
    return out


def _service_pid(run_pid: int, role: str) -> int | None:
    for pid, cmd in _children(run_pid).items():
        if f"services.{role} " in cmd + " " and "--replica 0" in cmd:
            return pid
    return None


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_each_role_killed_in_turn_the_run_completes_and_nothing_is_lost(tmp_path):
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run",
        "--profile", str(REPO / "profiles/local-cpu-ppo.toml"),
        "--name", "chaos", "--no-progress",
        "--run.runs_dir", str(runs),
        "--controller.steps", str(STEPS),
        "--learner.checkpoint_every", "1",
        "--controller.step_timeout_s", "120",
        "--learner.trainer.total_steps", str(STEPS),
    ]  # fmt: skip
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    run_dir = runs / "chaos"
    kills: list[dict[str, float | str | int]] = []
    try:
        for role, at in ROTATION:
            while _steps(run_dir) < at:
                assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
                time.sleep(0.1)
            pid = _service_pid(proc.pid, role)
            assert pid is not None, f"no {role} process under the supervisor"
            killed_at, step = time.monotonic(), _steps(run_dir)
            os.kill(pid, signal.SIGKILL)
            # recovered: a new process of the role is up and two more steps finished
            while _steps(run_dir) < step + 2:
                assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
                time.sleep(0.1)
            kills.append(
                {
                    "role": role,
                    "pid": pid,
                    "step": step,
                    "new_pid": _service_pid(proc.pid, role) or -1,
                    "recovered_s": round(time.monotonic() - killed_at, 1),
                }
            )
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the supervisor stops its children by pid
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    restarts = json.loads((run_dir / "supervisor.json").read_text())["restarts"]
    print(f"\n{'role':<11}{'pid':>8}{'new pid':>9}{'at step':>9}{'recovered s':>13}")
    for k in kills:
        print(f"{k['role']:<11}{k['pid']:>8}{k['new_pid']:>9}{k['step']:>9}{k['recovered_s']:>13}")
    print(
        f"released {summary['released']}  trained {summary['trained']}  dropped "
        f"{summary['dropped']}  duplicates {summary['duplicates']}  in flight at the end "
        f"{summary['in_flight_at_end']}  unknown {summary['unknown_trained']}  controller "
        f"incarnations {summary['incarnations']}"
    )
    assert summary["completed"] and summary["steps"] == STEPS
    for role, _ in ROTATION:
        assert restarts[f"{role}-0"] == 1, restarts
        assert all(k["new_pid"] not in (-1, k["pid"]) for k in kills)
    assert summary["duplicates"] == 0 and summary["unknown_trained"] == 0
    assert summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    learner_log = (run_dir / "logs" / "learner-0.log").read_text()
    assert '"resumed"' in learner_log  # the restarted learner loaded its last checkpoint
    assert summary["incarnations"] == 2  # the restarted controller resumed the same run
    assert '"controller_resumed"' in (run_dir / "logs" / "controller-0.log").read_text()
    steps = [
        json.loads(x)["step"]
        for x in (run_dir / "metrics/steps.jsonl").read_text().split("\n")
        if x
    ]
    # each step written once, in order, across both controllers (a learner killed after
    # its checkpoint reports that step again from the checkpoint; it does not skip it)
    assert steps == list(range(STEPS))
