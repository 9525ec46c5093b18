"""CURVE on non-loopback endpoints: refused without keys, authenticated and encrypted with
them, and a client without the keys gets nothing. The last test runs producer and consumers
in separate network namespaces joined by a veth pair, as if on separate hosts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from pipeline.errors import InsecureEndpoint
from pipeline.transport import QueueServer
from pipeline.transport.channel import free_tcp_port
from pipeline.transport.security import configure, make_keys
from tests import netns

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _plain_afterwards():
    yield
    configure(None)


def test_keys_are_made_and_a_non_loopback_bind_without_them_is_refused(tmp_path):
    keys = make_keys(tmp_path / "keys")
    assert {p.name for p in keys.iterdir()} >= {"server.key", "server.key_secret", "client.key"}
    assert (keys / "authorized" / "client.key").is_file()
    assert oct((keys / "server.key_secret").stat().st_mode & 0o777) == "0o600"
    configure(None)
    port = free_tcp_port()
    with pytest.raises(InsecureEndpoint, match="pipeline keys"):
        QueueServer("prompts", f"tcp://0.0.0.0:{port}", run_id="r", sender="s")
    configure(None, allow_insecure=True)  # explicitly allowed
    QueueServer("prompts", f"tcp://0.0.0.0:{port}", run_id="r", sender="s")._sock.close(0)
    configure(keys)  # with keys the same bind is a CURVE server
    server = QueueServer("prompts", f"tcp://0.0.0.0:{free_tcp_port()}", run_id="r", sender="s")
    assert server._sock.getsockopt(zmq.CURVE_SERVER) == 1
    server._sock.close(0)
    configure(None)
    QueueServer("prompts", f"tcp://127.0.0.1:{free_tcp_port()}", run_id="r", sender="s")


def test_a_curve_bound_weight_hub_closes_at_once(tmp_path):
    """Its context holds the ZAP handler's socket: term() waited on it forever."""
    from pipeline.weights.hub import WeightHub

    configure(make_keys(tmp_path / "keys"))
    hub = WeightHub(endpoint=f"tcp://0.0.0.0:{free_tcp_port()}", store_host="127.0.0.1")
    closer = threading.Thread(target=hub.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "WeightHub.close() hung in zmq term"


@pytest.fixture
def two_hosts():
    with netns.two_hosts() as (a, b):
        yield a.ns, b.ns, a.ip


def _peer(ns: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}", PIPELINE_LOG_LEVEL="warning")
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.transport.curve_peer", *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:  # by pid, never by name
            proc.kill()
            proc.wait(5)


def test_queue_across_network_namespaces_with_curve_refuses_a_client_without_keys(
    two_hosts, tmp_path
):
    ns_a, ns_b, host_a = two_hosts
    keys = str(make_keys(tmp_path / "keys"))
    stranger = str(make_keys(tmp_path / "stranger"))  # a valid key pair nobody authorised
    endpoint = f"tcp://{host_a}:{free_tcp_port()}"
    n = 20
    producer = _peer(ns_a, "produce", endpoint, str(n), "--keys", keys)
    # no keys at all, and keys the server never authorised: both get nothing
    for extra in ([], ["--keys", stranger]):
        refused = _peer(ns_b, "consume", endpoint, "1", "--timeout", "3", *extra)
        assert _finish(refused, 30).split() == ["timeout"], f"{extra} was served"
    consumer = _peer(ns_b, "consume", endpoint, str(n), "--keys", keys)
    got = _finish(consumer, 60).split()
    assert got[-1] == "done" and sorted(got[:-1]) == sorted(f"u{i}" for i in range(n))
    assert f"acked {n}" in _finish(producer, 60)
