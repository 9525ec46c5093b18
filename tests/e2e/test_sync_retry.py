"""Weight syncs that fail more than `controller.max_staleness` times in a row do not stall
the run (issue 33, defect 2).

A real run (`pipeline run`, tiny model, one engine, max_staleness 1) whose engine fails to
load the first two updates from version 3 on (tests/standin/refusing_rollout.py): it
answers each at once with a failed WeightDone, so it stays registered and keeps serving
version 2. Two failed syncs in a row leave every sample it generates two versions stale:
the learner drops them all and never steps again, and nothing published again (no engine
joined or left), so the run ended as stalled. The learner now publishes the current
version again on a timer after a failed sync; the run completes all its steps.

A SIGSTOPped engine does not reproduce this: silent in the sync, it is dropped, and it
registers again when it wakes, which re-syncs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS, PER_STEP, N_SAMPLES = 8, 4, 2
REFUSE_FROM, REFUSALS = 3, 2  # more than max_staleness (1) failed syncs in a row


def _events(log: Path, name: str) -> list[dict]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == name:
            out.append(event)
    return out


def test_a_run_whose_syncs_fail_past_the_staleness_bound_in_a_row_completes(tmp_path, procs):
    runs = tmp_path / "runs"
    cmd = [
        "-m", "pipeline.cli", "run",
        "--profile", str(REPO / "profiles/local-cpu.toml"),
        "--name", "retry", "--no-progress",
        "--run.runs_dir", str(runs),
        "--controller.steps", str(STEPS),
        "--controller.prompts_per_step", str(PER_STEP),
        "--controller.max_inflight_prompts", str(3 * PER_STEP),
        "--controller.max_staleness", "1",
        # a stalled run ends in this time: the failure before the fix comes quickly
        "--controller.step_timeout_s", "30",
        "--rollout.n_samples", str(N_SAMPLES),
        "--services.reward.replicas", "1",
        "--task.warm_start_steps", "0",
        "--learner.trainer.total_steps", str(STEPS),
        "--services.rollout.module", "tests.standin.refusing_rollout",
    ]  # fmt: skip
    out = (tmp_path / "run.log").open("wb")
    run = procs.python(
        *cmd,
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={"REFUSING_ROLLOUT": f"{REFUSE_FROM}:{REFUSALS}"},
    )
    run_dir = runs / "retry"
    learner_log = run_dir / "logs" / "learner-0.log"
    try:
        assert run.wait(timeout=150) == 0
    except BaseException:
        sys.stderr.write((tmp_path / "run.log").read_text()[-3000:])
        sys.stderr.write(learner_log.read_text()[-5000:] if learner_log.exists() else "")
        raise
    finally:
        out.close()

    refused = _events(run_dir / "logs" / "rollout-0.log", "update_refused_for_test")
    assert len(refused) == REFUSALS
    failed = [e for e in _events(learner_log, "weight_sync_failed") if "version" in e]
    assert len(failed) == REFUSALS and {e["version"] for e in failed} >= {REFUSE_FROM}
    # the version the engines should serve was published again on the timer
    retries = _events(learner_log, "weight_sync_retry")
    assert retries and retries[0]["attempt"] == 1
    assert max(e["version"] for e in _events(learner_log, "weight_sync")) == STEPS
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS
    assert summary["duplicates"] == 0 and summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
