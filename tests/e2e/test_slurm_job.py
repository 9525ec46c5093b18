"""The rendered Slurm job, submitted to a real Slurm: a heterogeneous job of two components
(the controller's pool and a second pool, each one node of a two-node cluster on this
host, `tests/slurm_cluster.py`). A rollout step is SIGKILLed mid-run; its supervisor
(`pipeline service ROLE --supervise`, as the rendered srun line starts it) restarts it,
the job ends by itself, and the run trained to its last step with every released uid
trained once or counted dropped, as a local run does under chaos.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.two_pools import pipeline_command, two_pool_profile
from tests.slurm_cluster import SlurmCluster, slurm_cluster, unavailable

REPO = Path(__file__).resolve().parents[2]
STEPS, KILL_AT = 10, 3
JOB_TIMEOUT_S = 900
# a job in these states has not ended yet
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


@pytest.fixture
def slurm():
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            cluster = stack.enter_context(slurm_cluster())
        except RuntimeError as exc:
            pytest.skip(f"slurm did not start here: {str(exc)[-1500:]}")
        yield cluster


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _job_state(cluster: SlurmCluster, job: str) -> str:
    """The state of the job's first component (its batch script's), e.g. RUNNING."""
    text = cluster.command("scontrol", "show", "job", job)
    return text.split("JobState=", 1)[1].split()[0]


def _wait_for(what: str, done, cluster: SlurmCluster, job: str, out: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while not done():
        state = _job_state(cluster, job)
        assert state in ACTIVE, (
            f"job {job} is {state} before {what}\n{_tail(out)}\n{cluster.logs()}"
        )
        assert time.monotonic() < deadline, f"no {what} in {timeout} s\n{_tail(out)}"
        time.sleep(0.5)


def _tail(path: Path, limit: int = 4000) -> str:
    return path.read_text(errors="replace")[-limit:] if path.exists() else "(no job output)"


@pytest.mark.slow
def test_the_rendered_hetjob_runs_on_slurm_and_a_killed_step_is_restarted(slurm, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([*pipeline_command(), "keys", str(keys)], check=True, capture_output=True)
    profile = two_pool_profile(
        tmp_path / "slurm.toml",
        name="slurm",
        hosts=("127.0.0.1", "127.0.0.1"),
        keys=keys,
        steps=STEPS,
        controller_extra="step_timeout_s = 120\n",
    )
    deploy = tmp_path / "deploy"
    subprocess.run(
        [
            *(*pipeline_command(), "deploy", "render", "--profile", str(profile)),
            *("--target", "slurm", "--out", str(deploy)),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    script = deploy / "slurm.sbatch"
    assert "#SBATCH hetjob" in script.read_text()
    run_dir = tmp_path / "runs" / "slurm"
    # the job's environment is this one (sbatch exports it): `pipeline` of this checkout
    env = dict(
        slurm.env,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]),
        PIPELINE_KEYS_DIR=str(keys),
    )
    started = time.monotonic()
    job = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", "--time=30", str(script)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = tmp_path / f"pipeline-slurm-{job}.out"
    record = run_dir / "supervisor" / "rollout-0.json"
    try:
        _wait_for(f"step {KILL_AT}", lambda: _steps(run_dir) >= KILL_AT, slurm, job, out, 600)
        killed = json.loads(record.read_text())
        assert killed["service_pid"] is not None and killed["restarts"] == 0
        # the rollout process itself, by pid, from its supervisor's record
        os.kill(killed["service_pid"], signal.SIGKILL)
        _wait_for(
            "end of the job",
            lambda: _job_state(slurm, job) not in ACTIVE,
            slurm,
            job,
            out,
            JOB_TIMEOUT_S,
        )
    finally:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            if _job_state(slurm, job) in ACTIVE:
                slurm.command("scancel", job)
                deadline = time.monotonic() + 60
                while _job_state(slurm, job) in ACTIVE:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
        print(f"\nslurm job {job} ({slurm.version}) took {time.monotonic() - started:.1f} s")
    state = slurm.command("scontrol", "show", "job", job)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + _tail(out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS, summary
    assert summary["duplicates"] == 0 and summary["unknown_trained"] == 0
    assert summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    steps = [
        json.loads(x)["step"] for x in (run_dir / "metrics/steps.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(STEPS))
    # the killed rollout was started again by its step's supervisor, and the new process
    # joined the run: told to stop at the end, it exited 0
    restarted = json.loads(record.read_text())
    assert restarted["restarts"] == 1, restarted
    started_pids = [e["started"] for e in restarted["events"] if "started" in e]
    assert len(started_pids) == 2 and started_pids[0] == killed["service_pid"]
    assert restarted["events"][-1].get("exit") == 0, restarted
    for name in ("controller-0", "learner-0", "reward-0"):
        other = json.loads((run_dir / "supervisor" / f"{name}.json").read_text())
        assert other["restarts"] == 0 and other["events"][-1].get("exit") == 0, other
