"""Pieces shared by every channel: typed config, counters, socket set-up, event loop."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from pipeline.errors import ConfigError
from pipeline.transport.aiosock import AsyncSocket
from pipeline.transport.security import secure_bind, secure_connect
from pipeline.wire.codec import Limits

T = TypeVar("T")


@dataclass(frozen=True)
class ChannelConfig:
    """Flow control and liveness settings of one queue."""

    # items a consumer buffers per producer (the credit it grants)
    prefetch: int = 8
    # items a producer holds before `send` waits (backpressure to the caller)
    max_pending: int = 64
    # seconds between heartbeats on an idle link
    heartbeat_s: float = 0.5
    # a peer silent this long is dead: its unacknowledged items go to another consumer
    peer_timeout_s: float = 5.0
    limits: Limits = field(default_factory=Limits)

    def validate(self) -> None:
        if self.prefetch < 1:
            raise ConfigError("queue prefetch must be >= 1")
        if self.max_pending < 1:
            raise ConfigError("queue max_pending must be >= 1")
        if self.peer_timeout_s <= 2 * self.heartbeat_s:
            raise ConfigError(
                f"peer_timeout_s={self.peer_timeout_s} must exceed twice heartbeat_s="
                f"{self.heartbeat_s}; raise queues.peer_timeout_s"
            )


@dataclass
class ChannelStats:
    sent: int = 0
    received: int = 0
    acked: int = 0
    redelivered: int = 0
    duplicates: int = 0
    dead_peers: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    # rejections of each reason not logged yet, and when one was last
    _unlogged: Counter[str] = field(default_factory=Counter, repr=False)
    _logged_at: dict[str, float] = field(default_factory=dict, repr=False)

    def reject(
        self, log: Any, reason: str, detail: str, *, burst: int = 5, every_s: float = 10.0
    ) -> None:
        """Count a refused message. Log the first `burst` of each reason, then at most one
        line per `every_s` that says how many it did not log: a flood of bad messages
        is counted in full (`rejected.<reason>` in the metrics) without flooding the log."""
        self.rejected[reason] += 1
        now = time.monotonic()
        quiet = now - self._logged_at.get(reason, -math.inf) < every_s
        if self.rejected[reason] > burst and quiet:
            self._unlogged[reason] += 1
            return
        self._logged_at[reason] = now
        log.error(
            "message_rejected",
            reason=reason,
            detail=detail[:240],
            count=self.rejected[reason],
            not_logged=self._unlogged.pop(reason, 0),
        )

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "sent": self.sent,
            "received": self.received,
            "acked": self.acked,
            "redelivered": self.redelivered,
            "duplicates": self.duplicates,
            "dead_peers": self.dead_peers,
        }
        out.update({f"rejected.{k}": v for k, v in self.rejected.items()})
        return out


def new_identity(name: str) -> str:
    """Unique per process incarnation, so a restarted peer is told apart from its ghost."""
    return f"{name}:{os.getpid()}:{secrets.token_hex(3)}"


def is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_socket(ctx: zmq.Context, kind: int, identity: str | None = None) -> Any:
    """A socket of `ctx`'s own kind (blocking for `zmq.Context`), with the channel options."""
    return _configure(ctx.socket(kind), kind, identity)


def make_async_socket(ctx: zmq.Context, kind: int, identity: str | None = None) -> AsyncSocket:
    """A plain socket of any context, driven by the running loop (see `aiosock`)."""
    return AsyncSocket(_configure(zmq.Socket(ctx, kind), kind, identity))


def _configure(sock: Any, kind: int, identity: str | None) -> Any:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def bind(sock: Any, endpoint: str) -> str:
    """Bind; `tcp://host:0` picks a free port. Returns the endpoint actually bound."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        # only this user may reach the run's sockets (other local users cannot connect)
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket file from a dead incarnation
    secure_bind(sock, endpoint, loopback=is_loopback(endpoint))
    sock.bind(endpoint)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def connect(sock: Any, endpoint: str) -> None:
    """Connect; a non-loopback endpoint goes through CURVE when the run has keys."""
    secure_connect(sock, endpoint, loopback=is_loopback(endpoint))
    sock.connect(endpoint)


async def liveness_tick(interval_s: float, peers: Callable[[], Iterable[Any]]) -> float:
    """Sleep one heartbeat interval and return the time. Whatever this loop ran past its tick
    (its process paused, its loop blocked) is added to each peer's `last_seen`, capped at
    now: what the peers sent meanwhile waits unread in the sockets, so a late loop never
    takes its own lateness for their silence."""
    slept_at = time.monotonic()
    await asyncio.sleep(interval_s)
    now = time.monotonic()
    late = now - slept_at - interval_s
    if late > 0:
        for peer in peers():
            peer.last_seen = min(now, peer.last_seen + late)
    return now


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop (the project's event loop everywhere)."""
    import uvloop

    return uvloop.run(coro)


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], timeout: float = 2.0) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


async def guarded(step: Any, log: Any, stats: ChannelStats) -> None:
    """Run `await step()` forever; an unexpected error is logged and counted, not fatal."""
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            stats.rejected["internal_error"] += 1
            log.exception("receive_failed")
