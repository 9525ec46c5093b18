"""CURVE on non-loopback endpoints: refused without keys, authenticated and encrypted with
them, and a client without the keys gets nothing. The last test runs producer and consumers
in separate network namespaces joined by a veth pair, as if on separate hosts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zmq

from pipeline.errors import InsecureEndpoint
from pipeline.transport import QueueServer
from pipeline.transport.channel import free_tcp_port
from pipeline.transport.security import configure, make_keys

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


def _netns_available() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns)"
    probe = f"pl-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Namespaces a (10.77.x.1) and b (10.77.x.2) joined by a veth pair; removed after."""
    why = _netns_available()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:5]
    a, b = f"pl-a-{tag}", f"pl-b-{tag}"
    net = f"10.77.{int(tag[:2], 16)}"
    try:
        try:
            _sh("ip", "netns", "add", a)
            _sh("ip", "netns", "add", b)
            _sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
            _sh("ip", "link", "set", f"va{tag}", "netns", a)
            _sh("ip", "link", "set", f"vb{tag}", "netns", b)
            for ns, dev, ip in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
                _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:  # e.g. no veth support in this kernel
            pytest.skip(f"cannot build the two namespaces: {' '.join(exc.cmd)}: {exc.stderr}")
        yield a, b, f"{net}.1"
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


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
