"""`pipeline service ROLE --supervise`: one replica restarted by the local supervisor's
rules. The service is a stand-in script that exits with the codes it is given in turn."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import EXIT_CONFIG
from pipeline.runtime import replica_supervisor
from pipeline.runtime.replica_supervisor import ReplicaSupervisor, restartable

REPO = Path(__file__).resolve().parents[2]

# exits with the next code of CODES (a negative one: killed by that signal); "wait" sleeps
SCRIPT = """
import os, signal, sys, time
codes, count = sys.argv[1].split(","), sys.argv[2]
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
code = codes[min(n, len(codes) - 1)]
if code == "wait":
    time.sleep(60)
elif int(code) < 0:
    os.kill(os.getpid(), -int(code))
sys.exit(int(code))
"""


def _supervisor(tmp_path: Path, role: str, codes: str, max_restarts: int = 3):
    config = load_config(
        str(REPO / "profiles/local-cpu.toml"),
        {
            "run.runs_dir": str(tmp_path),
            "run.name": "r",
            "supervisor.max_restarts": str(max_restarts),
        },
    )
    sup = ReplicaSupervisor(config, role, 0, [])
    sup.argv = [sys.executable, "-c", SCRIPT, codes, str(tmp_path / "count")]
    return sup


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(replica_supervisor, "RESTART_BACKOFF_S", 0.0)


def test_the_rules_are_the_local_supervisors():
    assert restartable("rollout", -9) and restartable("learner", 1)
    assert not restartable("rollout", 0) and not restartable("reward", EXIT_CONFIG)
    assert restartable("controller", -9)
    assert not restartable("controller", 1) and not restartable("controller", 0)


def test_a_killed_service_is_restarted_and_recorded(tmp_path):
    sup = _supervisor(tmp_path, "rollout", "-9,1,0")
    assert sup.run() == 0
    record = json.loads((tmp_path / "r" / "supervisor" / "rollout-0.json").read_text())
    assert record["restarts"] == 2
    assert [e.get("exit") for e in record["events"] if "exit" in e] == [-9, 1, 0]
    assert len([e for e in record["events"] if "started" in e]) == 3


def test_the_budget_ends_a_crash_loop(tmp_path):
    sup = _supervisor(tmp_path, "reward", "1", max_restarts=2)
    assert sup.run() == 1
    assert sup.restarts == 2


def test_a_refused_config_and_a_controller_that_ended_are_not_restarted(tmp_path):
    assert _supervisor(tmp_path, "reward", str(EXIT_CONFIG)).run() == EXIT_CONFIG
    (tmp_path / "count").unlink()
    sup = _supervisor(tmp_path, "controller", "3")
    assert sup.run() == 3 and sup.restarts == 0


def test_sigterm_stops_the_service_and_the_loop(tmp_path):
    sup = _supervisor(tmp_path, "learner", "wait")

    def stop() -> None:
        while sup.proc is None:
            time.sleep(0.05)
        time.sleep(0.3)
        sup._on_signal(signal.SIGTERM, None)

    threading.Thread(target=stop, daemon=True).start()
    assert sup.run() == 128 + signal.SIGTERM
    assert sup.restarts == 0


def test_a_service_left_out_of_the_end_of_the_run_is_stopped(tmp_path):
    """Restarted after the controller told the others to stop, it never joined the end."""
    sup = _supervisor(tmp_path, "rollout", "wait")
    run_dir = tmp_path / "r"
    run_dir.mkdir(parents=True, exist_ok=True)

    def end_run() -> None:
        while sup.proc is None:
            time.sleep(0.05)
        summary = {"told_to_stop": ["reward-0"], "told_at": time.time()}
        (run_dir / "summary.json").write_text(json.dumps(summary))

    threading.Thread(target=end_run, daemon=True).start()
    assert sup.run() == 128 + signal.SIGTERM


def test_python_m_service_takes_supervise_as_pipeline_service_does(tmp_path):
    """`python -m services.ROLE --supervise` runs the replica as a supervised child (here a
    stand-in module that exits 0 at once), and records it; unsupervised it would serve."""
    import subprocess

    cmd = [sys.executable, "-m", "services.reward", "--supervise"]
    cmd += ["--profile", "profiles/local-cpu.toml", "--run.runs_dir", str(tmp_path)]
    cmd += ["--run.name", "r", "--services.reward.module", "tests.standin.exits"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "r" / "supervisor" / "reward-0.json").read_text())
    assert record["restarts"] == 0
    assert [e.get("exit") for e in record["events"] if "exit" in e] == [0]
