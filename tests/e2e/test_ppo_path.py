"""The KL-PPO reference configuration end to end: critic service, GAE, KL loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.wire.recording import QueueReader

REPO = Path(__file__).resolve().parents[2]


def test_critic_annotates_every_group_and_trains(tmp_path):
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            "--name",
            "ppo",
            "--no-progress",
            "--profile",
            str(REPO / "profiles/local-cpu-ppo.toml"),
            "--run.runs_dir",
            str(runs),
            "--controller.steps",
            "4",
            "--controller.prompts_per_step",
            "8",
            # no warm start of the tiny model: nothing here needs it to learn (~10 s less)
            "--task.warm_start_steps",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = runs / "ppo"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0
    groups = [r.decode() for r in QueueReader(run / "queues/experience.log")]
    assert groups
    for msg in groups:
        for s in msg.body.samples:
            n = s.response_ids.shape[0]
            for ref in (s.values, s.advantages, s.returns):
                assert ref is not None and msg.tensor(ref).shape == (n,)
            assert np.isfinite(msg.tensor(s.advantages)).all()
    log = (run / "logs/critic-0.log").read_text()
    assert log.count('"critic_step"') == 4  # one value update per step's worth of groups
    steps = [json.loads(x) for x in (run / "metrics/steps.jsonl").read_text().splitlines()]
    assert all("kl/k3" in s and "actor/kl_loss" in s for s in steps)
