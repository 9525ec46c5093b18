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


def _stop(proc: subprocess.Popen) -> None:
    """A run still going: SIGINT (the supervisor stops its children by pid), else kill."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("critic_groups", ["1", "4"])  # critic.annotate_max_groups
def test_each_role_killed_in_turn_the_run_completes_and_nothing_is_lost(tmp_path, critic_groups):
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
        "--critic.annotate_max_groups", critic_groups,
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
            # recovered: a new process of the role is up and two more steps finished (the
            # steps alone can come first: buffered samples carry the run past a killed role)
            while _steps(run_dir) < step + 2 or _service_pid(proc.pid, role) in (None, pid):
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
        _stop(proc)
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


# ----------------------------------------------------------------------------- schedule
# (at step, action, argument): kill -9 a role; pause a role (SIGSTOP, seconds, SIGCONT);
# rogue local peers forging StepDone, Hello and Credit for some seconds; busy processes
# starving the CPU for some seconds; the learner's latest checkpoint corrupted, then the
# learner killed (it resumes from the one before)
SHORT = [
    (3, "kill", "rollout"),
    (8, "pause", ("reward", 8.0)),
    (13, "rogue", 3.0),
    (18, "corrupt_and_kill", "learner"),
]
FULL = [
    (3, "kill", "rollout"),
    (6, "pause", ("reward", 8.0)),
    (9, "rogue", 5.0),
    (12, "pause", ("rollout", 20.0)),
    (15, "kill", "reward"),
    (18, "starve", 10.0),
    (21, "corrupt_and_kill", "learner"),
    (25, "pause", ("learner", 20.0)),
    (28, "kill", "critic"),
    (31, "pause", ("controller", 8.0)),
    (34, "kill", "controller"),
    (37, "pause", ("critic", 60.0)),
]


def _wait_steps(proc: subprocess.Popen, run_dir: Path, at: int, log: Path) -> None:
    while _steps(run_dir) < at:
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)


def _corrupt_latest(run_dir: Path) -> str:
    root = run_dir / "checkpoints" / "learner"
    latest = root / (root / "latest").read_text().strip()
    (latest / ".metadata").write_bytes(b"\x80\x04not a checkpoint")
    return latest.name


def _act(proc: subprocess.Popen, run_dir: Path, action: str, arg, stats: dict):
    """Start one event; a pause, rogue peers or starvation last their seconds in a thread
    (returned) while the run and the schedule go on: a run faster than the event would
    otherwise be over before the next one."""
    import threading

    from pipeline.config import load_config
    from tests.e2e.test_forged_peers import _forge

    if action in ("kill", "corrupt_and_kill"):
        pid = _service_pid(proc.pid, arg)
        assert pid is not None, f"no {arg} process"
        if action == "corrupt_and_kill":  # stopped first: no newer save moves `latest` on
            os.kill(pid, signal.SIGSTOP)
            stats["corrupted"].append(_corrupt_latest(run_dir))
        os.kill(pid, signal.SIGKILL)
        stats["kills"] += 1
        return None
    if action == "pause":
        role, seconds = arg
        pid = _service_pid(proc.pid, role)
        assert pid is not None, f"no {role} process"
        os.kill(pid, signal.SIGSTOP)
        stats["pauses"] += 1

        def event() -> None:
            time.sleep(seconds)
            os.kill(pid, signal.SIGCONT)
    elif action == "rogue":
        config = load_config(
            "profiles/local-cpu.toml",
            {"run.runs_dir": str(run_dir.parent), "run.name": run_dir.name},
        )

        def event() -> None:
            stop, sent = threading.Event(), [0]
            rogue = threading.Thread(target=_forge, args=(config, stop, sent), daemon=True)
            rogue.start()
            time.sleep(arg)
            stop.set()
            rogue.join(10)
            stats["forged"] += sent[0]
    elif action == "starve":

        def event() -> None:
            busy = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)
            ]
            try:
                time.sleep(arg)
            finally:
                for p in busy:  # by pid
                    p.kill()
                    p.wait()
            stats["starved_s"] += arg
    else:
        raise ValueError(action)
    thread = threading.Thread(target=event, daemon=True)
    thread.start()
    return thread


def _chaos(tmp_path: Path, profile: str, steps: int, schedule: list, *extra: str) -> None:
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run",
        "--profile", str(REPO / profile),
        "--name", "chaos", "--no-progress",
        "--run.runs_dir", str(runs),
        "--controller.steps", str(steps),
        "--learner.checkpoint_every", "1",
        "--controller.step_timeout_s", "180",
        "--learner.trainer.total_steps", str(steps),
        *extra,
    ]  # fmt: skip
    log_path = tmp_path / "run.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    run_dir = runs / "chaos"
    stats = {"kills": 0, "pauses": 0, "forged": 0, "starved_s": 0.0, "corrupted": []}
    recovery: list[float] = []
    started = time.monotonic()
    events = []
    try:
        for at, action, arg in schedule:
            _wait_steps(proc, run_dir, at, log_path)
            began, step = time.monotonic(), _steps(run_dir)
            events.append(_act(proc, run_dir, action, arg, stats))
            while _steps(run_dir) <= step and proc.poll() is None:  # or the run ended
                time.sleep(0.1)
            recovery.append(round(time.monotonic() - began, 1))
        assert proc.wait(timeout=900) == 0, log_path.read_text()[-3000:]
    finally:
        for event in events:
            if event is not None:
                event.join(120)
        _stop(proc)
        log.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics/steps.jsonl").read_text().splitlines()]
    # counted per process: a restarted controller or learner starts again from 0
    keys = {k for row in rows for k in row if "/refused." in k}
    refused = sum(max(row.get(k, 0.0) for row in rows) for k in keys)
    print(
        f"\nchaos: {len(schedule)} events in {time.monotonic() - started:.0f} s: kills "
        f"{stats['kills']}, pauses {stats['pauses']}, forged messages sent "
        f"{stats['forged']} (handshakes refused {refused:.0f}), CPU starved "
        f"{stats['starved_s']:.0f} s, corrupted checkpoints {stats['corrupted']}; seconds "
        f"from each event to the next step {recovery}; released {summary['released']} "
        f"trained {summary['trained']} dropped {summary['dropped']}"
    )
    assert summary["completed"] and summary["steps"] == steps
    assert summary["duplicates"] == 0 and summary["unknown_trained"] == 0
    assert summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    if stats["forged"]:
        assert refused >= 1
    if stats["corrupted"]:
        learner_log = (run_dir / "logs" / "learner-0.log").read_text()
        assert '"checkpoint_unreadable"' in learner_log


def test_chaos_short_schedule(tmp_path):
    """make test: a kill, a pause past the peer timeout, rogue peers, a corrupted
    checkpoint; the run finishes by itself with every sample accounted for. Five steps
    between events and eight after the last (not 60 steps in all), and no warm start of the
    tiny model (nothing here needs it to learn): ~50 s, not ~90 s, on 2 cores."""
    _chaos(tmp_path, "profiles/local-cpu.toml", 26, SHORT, "--task.warm_start_steps", "0")


@pytest.mark.slow
def test_chaos_full_schedule(tmp_path):
    _chaos(tmp_path, "profiles/local-cpu-ppo.toml", 60, FULL)
