"""At a run's end the supervisor lets the services save their last state and exit on
their own (`supervisor.save_timeout_s`), instead of stopping them after
`supervisor.stop_timeout_s` in the middle of a trainer's last checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.runtime import layout

REPO = Path(__file__).resolve().parents[2]


def test_a_last_save_longer_than_the_stop_timeout_completes(tmp_path: Path):
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--no-progress", "--name", "slow"]
    cmd += ["--run.runs_dir", str(tmp_path), "--controller.steps", "2"]
    cmd += ["--task.warm_start_steps", "0", "--supervisor.stop_timeout_s", "1"]
    cmd += ["--services.learner.module", "tests.standin.slow_saving_learner"]
    env = dict(os.environ, SLOW_SAVE_S="4")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((tmp_path / "slow/supervisor.json").read_text())["events"]
    exits = {e["service"]: e["exit"] for e in events if "exit" in e}
    assert exits.get("learner-0") == 0, events  # exited on its own, not killed
    log = (tmp_path / "slow/logs/learner-0.log").read_text()
    assert '"saved"' in log and "service_killed" not in proc.stderr
    # the run's ipc socket directory is removed at its end (issue 33, defect 10)
    config = load_config(
        "profiles/local-cpu.toml", {"run.runs_dir": str(tmp_path), "run.name": "slow"}
    )
    assert not layout.socket_dir(config).exists()
