"""Every socket authenticated: the run's secret on loopback and ipc://, CURVE elsewhere.

A run's processes share a secret (`run_dir/run.secret`, 0600, made at the run's start):
loopback and ipc:// sockets are ZeroMQ PLAIN servers and clients with it, so a local process
that is not part of the run cannot connect (its handshake fails and is counted). PLAIN
costs one check per connection, nothing per message. Non-loopback endpoints use CURVE with
keys from `pipeline keys DIR`.

Layout of DIR (pyzmq's certificate files, Z85 text, never pickle):
  server.key / server.key_secret   the binding side (every producer and the controller)
  client.key / client.key_secret   the connecting side
  authorized/client.key            public keys the servers accept (ZAP, one file each)

A socket that binds a non-loopback address becomes a CURVE server and only completes the
handshake with a client whose public key is in `authorized/`; a socket that connects to a
non-loopback address is a CURVE client of the server key.
Binding a non-loopback address without keys raises `InsecureEndpoint` unless the run sets
run.allow_insecure. Not covered: torch.distributed's TCPStore and the NCCL/gloo sockets of
the weight and learner groups carry no authentication; keep them on a private network.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from pipeline.errors import InsecureEndpoint
from pipeline.transport.auth import PLAIN_USER, Gate

SECRET_FILE = "run.secret"


@dataclass(frozen=True)
class Security:
    keys_dir: Path | None = None
    allow_insecure: bool = False
    run_secret: str | None = None


_state = {"security": Security()}
_gates: dict[int, Gate] = {}
_stopped: Counter[str] = Counter()
_lock = threading.Lock()


def configure(
    keys_dir: str | Path | None, allow_insecure: bool = False, run_secret: str | None = None
) -> None:
    """Set this process's keys and the run's secret (every service calls it with the run's
    config); without a secret, loopback and ipc:// sockets take any local peer."""
    path = Path(keys_dir).expanduser().resolve() if keys_dir else None
    _state["security"] = Security(path, allow_insecure, run_secret)


def run_secret(run_dir: Path) -> str:
    """The run's secret, `run_dir/run.secret` (0600): made by the first of the run's
    processes to ask (the supervisor, or the first service started by hand), read by the
    rest. Written whole before it appears: a reader never sees half of it."""
    path = run_dir / SECRET_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".secret-")  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            with contextlib.suppress(FileExistsError):  # another process made it first
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    if path.stat().st_mode & 0o077:
        raise InsecureEndpoint(f"{path} is readable by other users: chmod 600 {path}")
    return path.read_text().strip()


def current() -> Security:
    return _state["security"]


def make_keys(directory: str | Path) -> Path:
    """Write a server and a client key pair and authorise the client; returns the dir."""
    import zmq.auth

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(out), name)
    authorized = out / "authorized"
    authorized.mkdir(exist_ok=True)
    shutil.copy(out / "client.key", authorized / "client.key")
    for secret in out.glob("*.key_secret"):
        secret.chmod(0o600)
    return out


def _load(name: str) -> tuple[bytes, bytes]:
    import zmq.auth

    keys = current().keys_dir
    assert keys is not None
    path = keys / f"{name}.key_secret"
    if not path.is_file():
        raise InsecureEndpoint(f"{path} is missing; make the keys with `pipeline keys {keys}`")
    public, secret = zmq.auth.load_certificate(str(path))
    assert secret is not None
    return public, secret


def _gate(ctx: Any) -> Gate:
    """The context's ZAP handler, started on first use: the run's secret for PLAIN, the
    public keys in keys_dir/authorized for CURVE."""
    sec = current()
    with _lock:
        gate = _gates.get(id(ctx))
        if gate is None:
            authorized = sec.keys_dir / "authorized" if sec.keys_dir is not None else None
            gate = Gate(ctx, secret=sec.run_secret, curve_keys=authorized)
            gate.start()
            _gates[id(ctx)] = gate
        return gate


def release(ctx: Any) -> None:
    """Stop the ZAP handler of `ctx`, if it has one. Call it before `ctx.term()`: the
    handler's socket lives on that context, so term would otherwise wait for it forever."""
    with _lock:
        gate = _gates.pop(id(ctx), None)
        if gate is not None:
            _stopped.update(gate.counts())
    if gate is not None:
        gate.stop()


def refused() -> dict[str, int]:
    """Handshakes this process's sockets refused, by reason (a peer without the run's
    secret or key), since it started."""
    with _lock:
        total = Counter(_stopped)
        for gate in _gates.values():
            total.update(gate.counts())
    return dict(total)


def secure_bind(sock: Any, endpoint: str, *, loopback: bool) -> None:
    """Make `sock` a CURVE server before binding a non-loopback `endpoint`."""
    sec = current()
    if loopback:
        if sec.run_secret is not None:  # only the run's processes know it
            _gate(sock.context).watch(sock, endpoint)
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        return
    if sec.keys_dir is None:
        if sec.allow_insecure:
            return
        raise InsecureEndpoint(
            f"refusing to bind {endpoint} without CURVE keys: run `pipeline keys DIR` and set "
            "run.keys_dir = DIR on every host (or run.allow_insecure = true on a trusted "
            "network)"
        )
    public, secret = _load("server")
    _gate(sock.context).watch(sock, endpoint)
    # setsockopt, not attributes: `sock` may be a wrapper (AsyncSocket) around the socket
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def secure_connect(sock: Any, endpoint: str, *, loopback: bool) -> None:
    """Make `sock` a PLAIN client with the run's secret for a loopback `endpoint`, a CURVE
    client of the run's server key for any other."""
    sec = current()
    if loopback:
        if sec.run_secret is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, sec.run_secret.encode())
        return
    if sec.keys_dir is None:
        return
    server_public, _ = _load("server")
    public, secret = _load("client")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
