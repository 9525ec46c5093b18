"""A learner SIGKILLed between its checkpoint and its acknowledgements trains nothing twice.

A real run (`pipeline run`, tiny model, a checkpoint every step, every checkpoint kept).
The learner's test hook parks it at step 2 right after the checkpoint (before the weights
are published, the step reported or its groups acknowledged) and at step 4 after the
report but before the acks; each time it is SIGKILLed there and the supervisor restarts
it. The restarted learner's weights already include the step, and the step's groups come
back unacknowledged: it must acknowledge them without training them (nor drop them as
stale: they were trained) and report the step again. The learner's own record of what it
trained (each checkpoint's `trained_step`) and the controller's (journal, steps.jsonl,
schedule.jsonl, summary) must both show every sample trained exactly once, at one step,
none of them also dropped, and every step reported once.
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
STEPS, PER_STEP, N_SAMPLES = 8, 4, 2
HOLDS = [("checkpointed", 2), ("reported", 4)]


def _events(log: Path, name: str) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line torn by the kill, or not JSON
        if event.get("event") == name:
            out.append(event)
    return out


def _run_command(runs: Path, name: str, *extra: str) -> list[str]:
    """`pipeline run` of the tiny task: STEPS steps of PER_STEP prompts x N_SAMPLES."""
    return [
        "-m", "pipeline.cli", "run",
        "--profile", str(REPO / "profiles/local-cpu.toml"),
        "--name", name, "--no-progress",
        "--run.runs_dir", str(runs),
        "--controller.steps", str(STEPS),
        "--controller.prompts_per_step", str(PER_STEP),
        "--controller.max_inflight_prompts", str(3 * PER_STEP),
        "--controller.step_timeout_s", "60",
        "--rollout.n_samples", str(N_SAMPLES),
        "--services.reward.replicas", "1",
        "--task.warm_start_steps", "0",
        "--learner.trainer.total_steps", str(STEPS),
        # the learner, parked where the test kills it (tests/standin/held_learner.py)
        "--services.learner.module", "tests.standin.held_learner",
        *extra,
    ]  # fmt: skip


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_a_learner_killed_after_its_checkpoint_trains_no_sample_twice(tmp_path, procs):
    runs = tmp_path / "runs"
    cmd = _run_command(runs, "lrn", "--learner.checkpoint_every", "1")
    cmd += ["--learner.keep_checkpoints", str(STEPS + 1)]
    hold = ",".join(f"{point}@{step}" for point, step in HOLDS)
    out = (tmp_path / "run.log").open("wb")
    run = procs.python(
        *cmd,
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={"HELD_LEARNER": hold},
    )
    run_dir = runs / "lrn"
    learner_log = run_dir / "logs" / "learner-0.log"
    killed = []
    try:
        for n, (point, step) in enumerate(HOLDS):
            deadline = time.monotonic() + 120
            while len(held := _events(learner_log, "held_for_test")) <= n:
                assert run.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            assert (held[n]["point"], held[n]["step"]) == (point, step)
            pid = held[n]["pid"]
            assert _parent(pid) == run.pid  # a learner of this run's supervisor
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        assert run.wait(timeout=120) == 0
    except BaseException:
        sys.stderr.write((tmp_path / "run.log").read_text()[-3000:])
        if learner_log.exists():
            sys.stderr.write(learner_log.read_text()[-5000:])
        raise
    finally:
        out.close()

    # the learner's record: the report each checkpoint carries, one per step trained
    reports = {}
    for meta in sorted((run_dir / "checkpoints" / "learner").glob("step_*/meta.json")):
        done = json.loads(meta.read_text())["extra"]["trained_step"]["done"]
        reports[done["step"]] = done
    trained_by_learner = [uid for s in sorted(reports) for uid in reports[s]["trained_uids"]]
    twice = sorted({uid for uid in trained_by_learner if trained_by_learner.count(uid) > 1})
    assert not twice, f"trained twice: {twice}"
    # nothing trained was later dropped as stale (a group delivered again after its step)
    journal = [
        json.loads(x) for x in (run_dir / "controller/journal.jsonl").read_text().splitlines()
    ]
    dropped = {u for r in journal for u in r.get("uids", []) + r.get("dropped_uids", [])}
    assert not dropped & set(trained_by_learner), "trained, then dropped when delivered again"
    assert sorted(reports) == list(range(STEPS))

    # the controller's record agrees, step by step
    steps = [json.loads(x) for x in (run_dir / "metrics/steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    schedule = [json.loads(x) for x in (run_dir / "schedule.jsonl").read_text().splitlines()]
    for s in range(STEPS):
        at_step = sorted(r["uid"] for r in schedule if r["step"] == s)
        assert at_step == sorted(reports[s]["trained_uids"]), s
    assert len(schedule) == len(trained_by_learner)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS
    assert summary["duplicates"] == 0 and summary["unknown_trained"] == 0
    assert summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    assert summary["trained"] * N_SAMPLES == len(trained_by_learner)

    # each restart settled the step its checkpoint ended with; the step the controller
    # never heard of (killed before the report) has the trainer's metrics from there
    settled = _events(learner_log, "resumed_step_settled")
    assert [e["step"] for e in settled] == [step for _, step in HOLDS]
    # by the process started after each kill
    assert [e["pid"] for e in settled][:-1] == killed[1:]
    assert settled[-1]["pid"] not in killed
    restarts = json.loads((run_dir / "supervisor.json").read_text())["restarts"]
    assert restarts["learner-0"] == len(HOLDS)
    # the step it had (killed after the report) came again as the same report
    again = _events(run_dir / "logs" / "controller-0.log", "step_reported_again")
    assert HOLDS[1][1] in {e["step"] for e in again}
    first_hold = steps[HOLDS[0][1]]
    assert first_hold["trained"] == PER_STEP * N_SAMPLES and "actor/loss" in first_hold


@pytest.mark.slow
def test_a_learner_resumed_behind_its_reports_goes_on_numbering_from_the_controller(
    tmp_path, procs
):
    """checkpoint_every 0: a learner killed at step 4 restarts from the initial weights.
    Those five updates are lost (it says so), but it must not report steps 0..4 again (step
    numbers and versions go on from the controller's) nor train step 4's groups, which come
    back unacknowledged, a second time (the learner notes each step's groups durably before
    reporting it): every step reported once, no duplicates."""
    runs = tmp_path / "runs"
    cmd = _run_command(runs, "behind", "--learner.checkpoint_every", "0")
    out = (tmp_path / "run.log").open("wb")
    run = procs.python(
        *cmd,
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={"HELD_LEARNER": "reported@4"},
    )
    run_dir = runs / "behind"
    learner_log = run_dir / "logs" / "learner-0.log"
    try:
        deadline = time.monotonic() + 120
        while not (held := _events(learner_log, "held_for_test")):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert _parent(held[0]["pid"]) == run.pid
        os.kill(held[0]["pid"], signal.SIGKILL)
        assert run.wait(timeout=120) == 0
    except BaseException:
        sys.stderr.write((tmp_path / "run.log").read_text()[-3000:])
        raise
    finally:
        out.close()
    behind = _events(learner_log, "resumed_behind")
    assert len(behind) == 1 and behind[0]["reported_steps"] == 5
    assert behind[0]["checkpoint_step"] == 0 and behind[0]["lost_updates"] == 5
    steps = [json.loads(x) for x in (run_dir / "metrics/steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0
    assert summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
