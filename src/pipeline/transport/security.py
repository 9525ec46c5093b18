"""ZeroMQ CURVE on every non-loopback endpoint: keys from `pipeline keys DIR`.

Layout of DIR (pyzmq's certificate files, Z85 text, never pickle):
  server.key / server.key_secret   the binding side (every producer and the controller)
  client.key / client.key_secret   the connecting side
  authorized/client.key            public keys the servers accept (ZAP, one file each)

A socket that binds a non-loopback address becomes a CURVE server and only completes the
handshake with a client whose public key is in `authorized/`; a socket that connects to a
non-loopback address is a CURVE client of the server key. Loopback and ipc:// stay plain.
Binding a non-loopback address without keys raises `InsecureEndpoint` unless the run sets
run.allow_insecure. Not covered: torch.distributed's TCPStore and the NCCL/gloo sockets of
the weight and learner groups carry no authentication; keep them on a private network.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from pipeline.errors import InsecureEndpoint


@dataclass(frozen=True)
class Security:
    keys_dir: Path | None = None
    allow_insecure: bool = False


_state = {"security": Security()}
_authenticators: dict[int, Any] = {}
_lock = threading.Lock()


def configure(keys_dir: str | Path | None, allow_insecure: bool = False) -> None:
    """Set this process's keys (every service calls it with the run's config)."""
    path = Path(keys_dir).expanduser().resolve() if keys_dir else None
    _state["security"] = Security(keys_dir=path, allow_insecure=allow_insecure)


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


def _authenticator(ctx: Any) -> None:
    """One ZAP handler per context, accepting the public keys in keys_dir/authorized."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = current().keys_dir
    assert keys is not None
    with _lock:
        if id(ctx) in _authenticators:
            return
        # a plain context over the same ZeroMQ context: the handler thread blocks normally
        plain = zmq.Context.shadow(ctx.underlying)
        auth = ThreadAuthenticator(plain)
        auth.start()
        auth.configure_curve(domain="*", location=str(keys / "authorized"))
        _authenticators[id(ctx)] = (auth, plain)


def release(ctx: Any) -> None:
    """Stop the ZAP handler of `ctx`, if it has one. Call it before `ctx.term()`: the
    handler's socket lives on that context, so term would otherwise wait for it forever."""
    with _lock:
        entry = _authenticators.pop(id(ctx), None)
    if entry is not None:
        auth, _plain = entry
        auth.stop()


def secure_bind(sock: Any, endpoint: str, *, loopback: bool) -> None:
    """Make `sock` a CURVE server before binding a non-loopback `endpoint`."""
    if loopback:
        return
    sec = current()
    if sec.keys_dir is None:
        if sec.allow_insecure:
            return
        raise InsecureEndpoint(
            f"refusing to bind {endpoint} without CURVE keys: run `pipeline keys DIR` and set "
            "run.keys_dir = DIR on every host (or run.allow_insecure = true on a trusted "
            "network)"
        )
    public, secret = _load("server")
    _authenticator(sock.context)
    # setsockopt, not attributes: `sock` may be a wrapper (AsyncSocket) around the socket
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def secure_connect(sock: Any, endpoint: str, *, loopback: bool) -> None:
    """Make `sock` a CURVE client of the run's server key for a non-loopback `endpoint`."""
    if loopback or current().keys_dir is None:
        return
    server_public, _ = _load("server")
    public, secret = _load("client")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
