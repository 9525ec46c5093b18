"""Trainers save every `checkpoint_every` updates and every `checkpoint_every_s` seconds
(default 300 s): a crash loses minutes, not the run (issue 33, defect 6: the default
saved only at the end, and a learner crash lost every update so far)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.runtime.checkpoint_clock import CheckpointClock

REPO = Path(__file__).resolve().parents[2]


def test_due_by_steps_or_by_seconds_since_the_last_save():
    now = [0.0]
    clock = CheckpointClock(every_steps=0, every_s=300.0, now=lambda: now[0])
    now[0] = 299.0
    assert not clock.due(5)
    now[0] = 300.0
    assert clock.due(6)
    clock.saved(6)
    assert clock.saved_count == 6 and not clock.due(7)
    steps = CheckpointClock(every_steps=4, every_s=0.0, now=lambda: now[0])
    assert [c for c in range(1, 10) if steps.due(c)] == [4, 8]


def test_the_default_profile_saves_every_five_minutes():
    config = load_config("profiles/local-cpu.toml", {})
    assert config.learner.checkpoint_every_s == 300.0  # the critic's clock too


def test_a_run_saves_as_it_goes(tmp_path: Path):
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--no-progress", "--name", "clock"]
    cmd += ["--run.runs_dir", str(tmp_path), "--controller.steps", "4"]
    cmd += ["--task.warm_start_steps", "0", "--learner.checkpoint_every_s", "0.001"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "clock/logs/learner-0.log").read_text().splitlines()
    saved = [json.loads(x)["step"] for x in log if x.startswith("{") and '"checkpoint saved"' in x]
    assert saved[:4] == [1, 2, 3, 4], saved  # after each step, then the end's
