"""The toy tool task learns (issue 35's acceptance): the profile as a user runs it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_toy_tool_profile_learns_to_call_its_tool_within_ten_minutes(tmp_path):
    """~3 minutes on 2 cores: reward and well-used tool share from <= 0.2 over the first 10
    steps to >= 0.6 over the last 10."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--name", "tool", "--no-progress"]
    cmd += ["--profile", str(REPO / "profiles/local-cpu-tool.toml"), "--run.runs_dir", str(runs)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = runs / "tool"
    steps = [json.loads(x) for x in (run / "metrics/steps.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0
    assert summary["seconds"] < 600, summary["seconds"]
    for key in ("reward_mean", "rollout/tool_used"):
        values = [s[key] for s in steps]
        first, last = statistics.mean(values[:10]), statistics.mean(values[-10:])
        assert first <= 0.2 and last >= 0.6, (key, first, last)
    assert all(s["rollout/masked_tokens"] >= 0 for s in steps)
    assert statistics.mean(s["rollout/masked_tokens"] for s in steps[-10:]) >= 4  # " 482 ="
