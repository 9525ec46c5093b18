"""A local process that is not part of the run cannot steer it (issue 33, defect 1): its
forged StepDone(step=10**6) to the controller, Hello to the weight hub and Credit to a
queue never get through the handshake (the run's secret), are counted, and the run ends
with the step count it was given. Before the fix the forged StepDone ended a 400-step run
at step 215 as completed, and a forged Hello stalled the weight group for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from pipeline.config import load_config
from pipeline.runtime import layout
from pipeline.weights.link import hub_endpoint
from pipeline.wire import codec
from pipeline.wire.messages import Credit, Hello, StepDone

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _forge(config, stop: threading.Event, sent: list[int]) -> None:
    ctx = zmq.Context()
    targets = {
        layout.controller_endpoint(config): StepDone(
            step=10**6, policy_version=10**6, trained_uids=[]
        ),
        hub_endpoint(config): Hello(service="rollout", replica=7, pid=os.getpid()),
        layout.queue_endpoint(config, "prompts", 0): Credit(queue="prompts", credits=64),
    }
    socks = []
    for endpoint, body in targets.items():
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        socks.append((sock, body))
    seq = 0
    while not stop.is_set():
        for sock, body in socks:
            seq += 1
            frames = codec.encode(body, run_id="", sender="rogue", seq=seq)
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                pass
        time.sleep(0.05)
    for sock, _ in socks:
        sock.close(0)
    ctx.term()


def test_forged_step_done_hello_and_credit_from_a_local_process_are_refused(tmp_path: Path):
    overrides = {"run.runs_dir": str(tmp_path), "run.name": "forged"}
    config = load_config("profiles/local-cpu.toml", overrides)
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--no-progress", "--name", "forged"]
    cmd += ["--run.runs_dir", str(tmp_path), "--controller.steps", str(STEPS)]
    cmd += ["--task.warm_start_steps", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop, sent = threading.Event(), [0]
    rogue = threading.Thread(target=_forge, args=(config, stop, sent), daemon=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "forged/run.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        rogue.start()
        _, err = proc.communicate(timeout=300)
    finally:
        stop.set()
        if proc.poll() is None:  # by pid
            proc.kill()
            proc.wait(10)
    rogue.join(10)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert sent[0] > 0
    summary = json.loads((tmp_path / "forged/summary.json").read_text())
    assert summary["steps"] == STEPS and summary["completed"], summary
    assert summary["duplicates"] == 0 and summary["unknown_trained"] == 0
    rows = [
        json.loads(x)
        for x in (tmp_path / "forged/metrics/steps.jsonl").read_text().splitlines()
        if x
    ]
    last = rows[-1]
    refused = {k: v for k, v in last.items() if "/refused." in k}
    print("refused handshakes:", refused)
    assert sum(v for k, v in refused.items() if k.startswith("controller/")) >= 1
    assert sum(v for k, v in refused.items() if k.startswith("learner/")) >= 1
