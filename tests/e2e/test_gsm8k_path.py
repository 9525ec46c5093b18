"""A GSM8K-format dataset written by the project runs through the pipeline and its verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.wire.recording import QueueReader
from tests.gsm8k_fixture import write_gsm8k_fixture

REPO = Path(__file__).resolve().parents[2]


def test_gsm8k_fixture_flows_through_every_service(tmp_path):
    fixture = write_gsm8k_fixture(tmp_path / "data")
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            "--name",
            "gsm8k",
            "--no-progress",
            "--profile",
            str(REPO / "profiles/local-cpu.toml"),
            "--run.runs_dir",
            str(runs),
            "--task.dataset",
            str(fixture.rl_parquet),
            "--controller.steps",
            "2",
            "--controller.prompts_per_step",
            "4",
            "--rollout.n_samples",
            "2",
            "--rollout.max_new_tokens",
            "12",
            "--task.max_prompt_tokens",
            "400",
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
    run = runs / "gsm8k"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0
    scored = [r.decode().body for r in QueueReader(run / "queues/scored.log")]
    assert scored and all(b.data_source == "openai/gsm8k" for b in scored)
    assert all(b.reward_errors == 0 for b in scored)
    # the ground truth travelled with the prompt: the number after #### in the fixture
    assert all(b.ground_truth.lstrip("-").replace(".", "").isdigit() for b in scored)
