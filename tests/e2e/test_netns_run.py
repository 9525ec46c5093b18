"""A whole run across two network namespaces, as if on two hosts, with CURVE on.

Host a (one namespace) runs the controller and the learner, host b (another, joined to a
by a veth pair) runs rollout and reward; every service is its own process, started inside
its namespace as on its host (`pipeline service ROLE --pool POOL`), every ZeroMQ socket is
on a non-loopback address (so CURVE-encrypted and authenticated with keys made by
`pipeline keys`), and the weights go from the learner in a to the engine in b over gloo,
rendezvousing at the learner's TCPStore. The run must complete with every uid trained once
or dropped and the engine must have applied the learner's updates; a service without the
keys, or with a client key the run never authorised, is refused by the controller (the
queue-level refusal is in `tests/transport/test_curve.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import pytest

from pipeline.errors import EXIT_CONFIG
from tests import netns
from tests.e2e.two_pools import pipeline_command, two_pool_profile

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture
def hosts():
    with netns.two_hosts() as pair:
        yield pair


def _json_lines(path: Path, event: str) -> list[dict]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            rows.append(json.loads(line))
    return rows


def test_a_run_across_two_network_namespaces_with_curve(hosts, tmp_path):
    a, b = hosts
    keys = tmp_path / "keys"
    subprocess.run([*pipeline_command(), "keys", str(keys)], check=True, capture_output=True)
    profile = two_pool_profile(
        tmp_path / "netns.toml",
        name="netns",
        hosts=(a.ip, b.ip),
        keys=keys,
        steps=STEPS,
        run_extra=f'transport = "tcp"\nhost = "{a.ip}"\n',
    )
    run_dir = tmp_path / "runs" / "netns"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    outs: list[IO[bytes]] = []
    env = dict(os.environ, PIPELINE_LOG_JSON="1", PYTHONUNBUFFERED="1")
    pool_of = {a: "a", b: "b"}  # the profile's pool on each host

    def start(host: netns.Host, role: str, replica: int = 0, *extra: str, name: str = "") -> None:
        name = name or f"{role}-{replica}"
        cmd = [*host.exec_prefix(), *pipeline_command(), "service", role, "--profile", str(profile)]
        cmd += ["--pool", pool_of[host], "--replica", str(replica), *extra]
        out = (logs / f"{name}.log").open("wb")
        outs.append(out)
        procs[name] = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    started = time.monotonic()
    try:
        start(a, "controller")
        deadline = time.monotonic() + 120
        while not (run_dir / "run.json").exists():
            assert procs["controller-0"].poll() is None, "the controller ended early"
            assert time.monotonic() < deadline, "the controller did not prepare the run"
            time.sleep(0.1)
        # intruders first, on host b: no keys at all, and the run's keys but a client key
        # nobody authorised (a valid pair from another `pipeline keys`)
        intruder = tmp_path / "intruder"
        shutil.copytree(keys, intruder)
        stranger = tmp_path / "stranger"
        subprocess.run(
            [*pipeline_command(), "keys", str(stranger)], check=True, capture_output=True
        )
        for suffix in ("key", "key_secret"):
            shutil.copy(stranger / f"client.{suffix}", intruder / f"client.{suffix}")
        refused = {
            "no-keys": ["--run.keys_dir=''", "--run.allow_insecure", "true"],
            "unauthorised": ["--run.keys_dir", str(intruder)],
        }
        for name, extra in refused.items():
            start(b, "reward", 1, *extra, "--run.handshake_timeout_s", "4", name=name)
        # a key the run never authorised is refused by the controller's ZAP handler, which
        # tells the client: it exits at once as for a refused config. Without keys the
        # mechanisms differ and which side notices first is a race: the client that does
        # exits the same way, else its handshake's time limit ends it.
        assert procs["unauthorised"].wait(timeout=60) == EXIT_CONFIG, "unauthorised let in"
        log = (logs / "unauthorised.log").read_text()
        assert "refused this service's connection (bad_credentials)" in log
        assert procs["no-keys"].wait(timeout=60) != 0, "no-keys was let in"
        log = (logs / "no-keys.log").read_text()
        assert "HandshakeTimeout" in log or "(wrong_mechanism)" in log
        start(a, "learner")
        start(b, "reward")
        start(b, "rollout")
        code = procs["controller-0"].wait(timeout=300)
        assert code == 0, (logs / "controller-0.log").read_text()[-3000:]
        for name, proc in procs.items():
            if name not in refused:
                assert proc.wait(timeout=60) == 0, f"{name} exited with {proc.returncode}"
    finally:
        for proc in procs.values():  # by pid (each leads its own session)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for out in outs:
            out.close()
        print(f"\nrun across namespaces took {time.monotonic() - started:.1f} s")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS
    assert summary["duplicates"] == 0 and summary["in_flight_at_end"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    # the learner in a published every step over gloo; the engine in b applied them
    synced = _json_lines(logs / "learner-0.log", "weight_sync")
    assert len(synced) >= STEPS and {r["transport"] for r in synced} == {"gloo"}
    assert not _json_lines(logs / "learner-0.log", "weight_sync_failed")
    applied = _json_lines(logs / "rollout-0.log", "weight_sync_applied")
    assert applied and max(r["version"] for r in applied) == STEPS
    # the controller never heard from the intruders
    hellos = _json_lines(logs / "controller-0.log", "peer_hello")
    assert sorted(r["peer"] for r in hellos) == ["learner-0", "reward-0", "rollout-0"]
