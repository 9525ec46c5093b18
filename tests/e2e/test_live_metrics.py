"""Metrics as a run goes: TensorBoard events readable before the run ends, each step once
after the controller was killed and restarted, and a Weights & Biases run kept offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 14


def _scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_is_live_steps_are_written_once_and_wandb_runs_offline(tmp_path):
    from .test_chaos import _service_pid, _steps

    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--no-progress", "--name", "live"]
    cmd += ["--run.runs_dir", str(runs), "--controller.steps", str(STEPS)]
    cmd += ["--controller.prompts_per_step", "4", "--task.warm_start_steps", "0"]
    cmd += ["--services.reward.replicas", "1", "--metrics.wandb", "true"]
    out = (tmp_path / "run.log").open("wb")
    env = dict(os.environ, PIPELINE_LOG_JSON="1", WANDB_SILENT="true")
    for name in ("WANDB_MODE", "WANDB_PROJECT"):  # unset: our defaults, project asyncrl offline
        env.pop(name, None)
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    run_dir = runs / "live"
    try:
        deadline = time.monotonic() + 240
        live: list[tuple[int, float]] = []
        while len(live) < 3:  # read while the run goes on
            assert proc.poll() is None and time.monotonic() < deadline, "ended before 3 steps"
            time.sleep(0.5)
            if (run_dir / "tensorboard").exists():
                live = _scalars(run_dir / "tensorboard", "reward_mean")
        assert _steps(run_dir) < STEPS
        pid = _service_pid(proc.pid, "controller")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the supervisor restarts it; it resumes its journal
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["incarnations"] == 2
    events = _scalars(run_dir / "tensorboard", "reward_mean")
    assert [step for step, _ in events] == list(range(STEPS))  # each step once, in order
    lines = [json.loads(x) for x in (run_dir / "metrics/steps.jsonl").read_text().splitlines()]
    assert [round(v, 5) for _, v in events] == [round(x["reward_mean"], 5) for x in lines]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline and any(offline[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())
