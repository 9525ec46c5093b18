"""Multi-turn tool episodes in whole runs of profiles/local-cpu-tool.toml (real services):
an environment that fails some episodes (raises, hangs, returns garbage) fails those
episodes only, counted in the run's metrics; the learner of a recorded multi-turn async run
replays bit for bit; a rollout service killed with episodes in flight loses none of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.wire.recording import QueueReader
from pipeline.wire.samples import GroupArrays, read_group
from tests.e2e.cli_run import REPO, assert_replay_matches, cli_run, log_events, step_records
from tests.e2e.test_chaos import _children, _service_pid, _steps, _stop

PROFILE = "profiles/local-cpu-tool.toml"
FLAKY = f"{REPO / 'tests/envs/faulty_envs.py'}:FlakyLookupEnv"
SHORT = (
    "--task.warm_start_steps", "0",  # nothing here needs the model to be good at the task
    "--controller.prompts_per_step", "4",
    "--controller.max_inflight_prompts", "8",
)  # fmt: skip


def recorded_groups(run: Path, queue: str = "rollouts") -> dict[str, GroupArrays]:
    """The groups recorded on a queue, by uid (a redelivery recorded twice counts once)."""
    return {
        g.uid: g for g in (read_group(r.decode()) for r in QueueReader(run / f"queues/{queue}.log"))
    }


def env_counters(run: Path) -> dict[str, float]:
    """The rollout's last report of its environment counters."""
    lines = (run / "metrics/rollout-0.jsonl").read_text().splitlines()
    reports = [json.loads(x) for x in lines if '"env.episodes"' in x]
    assert reports, "the rollout never reported its environment counters"
    return reports[-1]


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cli_run(
        tmp_path_factory.mktemp("runs"),
        "flaky",
        *SHORT,
        *("--controller.steps", "4"),
        *("--environment.name", FLAKY, "--environment.step_timeout_s", "1"),
        *("--environment.workers", "2"),
        # one hang: the second prompt's first sample (episodes its worker hosts are lost)
        *("--environment.options.hang_prefix", "000001:"),
        profile=PROFILE,
        timeout=300,
    )


def test_a_flaky_environment_fails_episodes_not_the_run(flaky_run: Path) -> None:
    assert not _flaky_workers(), "environment workers outlived the run"
    summary = json.loads((flaky_run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4 and summary["duplicates"] == 0
    samples = [s for g in recorded_groups(flaky_run).values() for s in g.samples]
    finish = Counter(s.finish_reason for s in samples)
    assert finish["env_error"] >= 4 and finish["env_timeout"] == 1, finish
    assert finish["stop"] + finish["length"] > len(samples) / 2, finish  # most went on
    for s in samples:
        assert len(s.extra["loss_mask"]) == len(s.response_ids)
        if s.finish_reason.startswith("env_"):
            assert s.score == 0.0
    # each failure counted once, in the rollout's counters (its final report: teardown)
    counters = env_counters(flaky_run)
    assert counters["env.episodes"] == len(samples)
    assert counters["env.errors"] == finish["env_error"]
    assert counters["env.timeouts"] == finish["env_timeout"] == counters["env.restarts"]
    assert counters["env.lost"] == finish["env_lost"]
    restarts = log_events(flaky_run / "logs/rollout-0.log", "env_worker_restarted")
    assert len(restarts) == counters["env.restarts"]
    assert all(r["old_pid"] != r["new_pid"] for r in restarts)
    # and in every step's metrics: the per-episode means of the step's groups
    steps = step_records(flaky_run)
    assert len(steps) == 4
    assert sum(s["rollout/env_errors"] for s in steps) > 0
    assert sum(s["rollout/env_timeouts"] for s in steps) > 0
    assert all(0 <= s["rollout/env_errors"] + s["rollout/env_timeouts"] <= 1 for s in steps)
    assert all(s["rollout/turns"] >= 0 and "rollout/masked_tokens" in s for s in steps)


def test_replay_of_a_multi_turn_async_run_reproduces_the_learner_bit_for_bit(
    flaky_run: Path, tmp_path: Path
) -> None:
    steps = step_records(flaky_run)
    assert max(s["staleness_max"] for s in steps) == 1  # asynchronous (max_staleness 1)
    # the learner trained on episodes with environment tokens, and on failed ones
    scored = [s for g in recorded_groups(flaky_run, "scored").values() for s in g.samples]
    assert any(0 < s.extra["loss_mask"].sum() < len(s.extra["loss_mask"]) for s in scored)
    assert any(s.finish_reason.startswith("env_") for s in scored)
    keys = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "mismatch/kl")
    assert_replay_matches(flaky_run, tmp_path / "replay", keys, timeout=300)


def test_a_rollout_killed_mid_episode_loses_no_episode(tmp_path: Path) -> None:
    steps = 4
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run", "--name", "kill", "--no-progress",
        "--profile", str(REPO / PROFILE), "--run.runs_dir", str(runs), *SHORT,
        "--controller.steps", str(steps), "--rollout.n_samples", "4",
        # slow calls: the rollout always has episodes waiting on their environment
        "--environment.name", FLAKY, "--environment.workers", "4",
        "--environment.options.every", "1000000000", "--environment.options.slow_s", "0.1",
    ]  # fmt: skip
    log_path = tmp_path / "run.log"
    run_dir = runs / "kill"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            while _steps(run_dir) < 1:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.1)
            rollout = _service_pid(proc.pid, "rollout")
            assert rollout is not None, "no rollout process under the supervisor"
            workers = [p for p, cmd in _children(rollout).items() if "pipeline.envs.worker" in cmd]
            assert len(workers) == 4, _children(rollout)
            # stopped while counted: no episode ends between the count and the kill; a rollout
            # that ran ahead of the learner and holds none is let go on until it holds some
            while True:
                os.kill(rollout, signal.SIGSTOP)
                in_flight = _open_episodes(run_dir)
                if in_flight or _steps(run_dir) >= steps - 1:
                    break
                os.kill(rollout, signal.SIGCONT)
                time.sleep(0.05)
            os.kill(rollout, signal.SIGKILL)
            killed_at = _steps(run_dir)
            # its environment workers notice the orphaning and exit by themselves
            deadline = time.monotonic() + 10
            while any(_alive(p) for p in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(_alive(p) for p in workers), "environment workers outlived the rollout"
            assert proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        finally:
            _stop(proc)
    assert in_flight > 0, "no episode was in flight at the kill"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == steps
    assert killed_at < steps  # killed before the run's end, not after
    assert summary["duplicates"] == 0 and summary["unknown_trained"] == 0
    assert summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    assert json.loads((run_dir / "supervisor.json").read_text())["restarts"]["rollout-0"] == 1
    schedule = [json.loads(x)["uid"] for x in (run_dir / "schedule.jsonl").read_text().splitlines()]
    assert len(schedule) == len(set(schedule)) == steps * 4 * 4  # every sample trained once
    # the restarted rollout ran its episodes to their end: every trained sample is whole
    groups = recorded_groups(run_dir, "scored")
    trained = {u.rsplit("/", 1)[0] for u in schedule}
    for uid in trained:
        assert {s.finish_reason for s in groups[uid].samples} <= {"stop", "length", "turns"}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _open_episodes(run_dir: Path) -> int:
    """Prompts the rollout took from its queue and has not answered yet (recorded inputs
    less recorded outputs), as near the kill as it gets."""
    taken = {r.decode().body.uid for r in QueueReader(run_dir / "queues/prompts.log")}
    answered = set(recorded_groups(run_dir))
    return len(taken - answered)


def _flaky_workers() -> list[int]:
    """Live environment worker processes of FLAKY (no other test or run uses it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _alive(int(entry.name)):
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "pipeline.envs.worker" in cmd and FLAKY in cmd:
                out.append(int(entry.name))
    return out
