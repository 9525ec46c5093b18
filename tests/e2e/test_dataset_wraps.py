"""A dataset smaller than what a run releases: the cursor wraps around and the same record
is released again, sometimes twice in one release batch. Every release still gets its own
uid (a repeated uid is taken once downstream, which would leave a step one group short and
stall the run: seen in a 200-step run over 4,096 records)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_run_over_a_tiny_dataset_completes_with_unique_release_uids(tmp_path):
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run", "--no-progress",
        "--profile", str(REPO / "profiles/local-cpu.toml"),
        "--name", "wrap", "--run.runs_dir", str(runs),
        "--task.dataset_size", "6",
        "--task.warm_start_steps", "0",
        "--controller.steps", "4",
        "--controller.prompts_per_step", "8",
        "--controller.step_timeout_s", "60",
        "--rollout.n_samples", "2",
        "--services.reward.replicas", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = runs / "wrap"
    journal = [json.loads(x) for x in (run / "controller/journal.jsonl").read_text().splitlines()]
    released = [p["uid"] for r in journal if r.get("kind") == "release" for p in r["prompts"]]
    records = [uid.split(":", 1)[1] for uid in released]
    assert len(released) >= 32 and len(set(records)) <= 6  # every record released many times
    assert len(set(released)) == len(released), "a release uid repeated"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4
    assert summary["released"] == len(released)
    assert summary["trained"] + summary["dropped"] == summary["released"]
