"""A trainer service whose model is a local directory builds and warms up its trainer
while it waits for the controller's answer (pipeline.runtime.early_build), not after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.run_patches import patched_env

REPO = Path(__file__).resolve().parents[2]


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_learner_warms_up_before_any_controller_answers(tmp_path):
    from bench.e2e import shape_model

    model = tmp_path / "model"
    shape_model("tiny", model, "cpu")
    log = tmp_path / "learner.log"
    cmd = [
        sys.executable, "-m", "services.learner",
        "--profile", str(REPO / "profiles/local-cpu.toml"),
        "--model.path", str(model),
        "--run.runs_dir", str(tmp_path / "runs"),
        "--run.handshake_timeout_s", "120",
        # warm-up batches of a 16-sample step (the profile's is 256): the same compile,
        # without ~20 s of eager arithmetic on 2 cores
        "--controller.prompts_per_step", "4",
        "--rollout.n_samples", "4",
    ]  # fmt: skip
    # kernels "auto" on CPU: the blocks compiled by aot_eager
    env = patched_env("compiled_cpu", base=dict(os.environ, PIPELINE_LOG_JSON="1"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 110
        warmed: list[dict] = []
        while time.monotonic() < deadline and proc.poll() is None and not warmed:
            time.sleep(0.5)
            warmed = [e for e in _events(log) if e.get("event") == "warmed_up"]
        assert warmed, log.read_text()[-3000:]  # no controller exists: nothing answered
        assert warmed[0]["service"] == "learner" and warmed[0]["compile/frames"] > 0
        assert proc.poll() is None  # still waiting for its hello's answer
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
