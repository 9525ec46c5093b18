"""Messages the controller refuses reach every step's metrics (`controller/rejected.<reason>`,
TensorBoard with the rest) while the log holds a few lines of them (issue 33, defect 7:
the counters never left the process and every bad message was a log line). A local peer
without the run's secret never gets a message through; its handshakes are counted
(`controller/refused.<reason>`; issue 33, defect 1)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import zmq

from pipeline.config import load_config
from pipeline.runtime import layout

REPO = Path(__file__).resolve().parents[2]


def test_junk_sent_to_the_control_socket_is_counted_in_the_step_metrics(tmp_path: Path):
    overrides = {"run.runs_dir": str(tmp_path), "run.name": "junk"}
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--no-progress", "--name", "junk"]
    cmd += ["--run.runs_dir", str(tmp_path), "--controller.steps", "6"]
    cmd += ["--task.warm_start_steps", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    endpoint = layout.controller_endpoint(load_config("profiles/local-cpu.toml", overrides))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    rogue = zmq.Context.instance().socket(zmq.DEALER)  # knows the address, not the secret
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "junk/run.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        sock.setsockopt(zmq.PLAIN_USERNAME, b"pipeline")
        sock.setsockopt(zmq.PLAIN_PASSWORD, (tmp_path / "junk/run.secret").read_bytes().strip())
        sock.connect(endpoint)
        rogue.connect(endpoint)
        for _ in range(40):
            sock.send_multipart([b"\xc1\xc1", b"junk"])
            # once the controller refused its greeting the rogue has no peer to send to
            with contextlib.suppress(zmq.Again):
                rogue.send_multipart([b"\xc1\xc1", b"junk"], zmq.NOBLOCK)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        sock.close()
        rogue.close()
        if proc.poll() is None:
            proc.kill()
    steps = [
        json.loads(x) for x in (tmp_path / "junk/metrics/steps.jsonl").read_text().split("\n") if x
    ]
    assert steps[-1]["controller/rejected.malformed"] == 40  # the rogue's never arrived
    # which side notices the mechanism mismatch first decides the reason the controller sees:
    # wrong_mechanism, or handshake_failed when the rogue hung up first
    refused = {k: v for k, v in steps[-1].items() if k.startswith("controller/refused.")}
    assert set(refused) <= {
        "controller/refused.wrong_mechanism",
        "controller/refused.handshake_failed",
    }
    assert sum(refused.values()) >= 1, refused
    log = (tmp_path / "junk/logs/controller-0.log").read_text()
    assert log.count('"message_rejected"') <= 6
