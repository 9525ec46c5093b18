"""ZeroMQ authentication of this process's bound sockets: one ZAP handler per context and
a watch on every bound socket's failed handshakes; on the connecting side, a watch for the
server's refusal (`RefusalWatch`).

The handler accepts a PLAIN client whose password is the run's secret (loopback and ipc://
sockets) and a CURVE client whose public key is authorised (every other address). A peer
that fails the handshake (a wrong secret, no secret, an unknown key) never gets a message
through; each failure is counted by reason and logged a few times (`refused()`).
"""

from __future__ import annotations

import hmac
import itertools
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import zmq
from zmq.auth import load_certificates
from zmq.utils import z85

from pipeline.log import get_logger
from pipeline.transport.aiosock import AsyncSocket

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
PLAIN_USER = "pipeline"
_POLL_MS = 100
_LOGGED_PER_REASON = 5
_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "bad_credentials",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "wrong_mechanism",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
}
# what no retry mends: libzmq ends such a connection for good
_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_counter = itertools.count()


class Gate(threading.Thread):
    """The ZAP handler and handshake watch of one ZeroMQ context."""

    def __init__(self, ctx: Any, *, secret: str | None, curve_keys: Path | None) -> None:
        super().__init__(name="zap", daemon=True)
        # a plain context over the same ZeroMQ context: this thread's sockets block normally
        self.ctx = zmq.Context.shadow(ctx.underlying)
        self.secret = secret
        self.curve_keys: set[bytes] = set()
        if curve_keys is not None:
            self.curve_keys = set(load_certificates(str(curve_keys)))
        self.refused: Counter[str] = Counter()
        self._watch: queue.Queue[tuple[str, str]] = queue.Queue()
        self._halt = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self.log = get_logger("auth")

    def start(self) -> None:
        super().start()
        self._ready.wait(10)

    def watch(self, sock: Any, endpoint: str) -> None:
        """Count `sock`'s failed handshakes (call before it binds)."""
        address = f"inproc://pipeline-handshakes-{id(self)}-{next(_counter)}"
        sock.monitor(address, sum(_FAILURES))
        self._watch.put((address, endpoint))

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.refused)

    def run(self) -> None:
        zap = self.ctx.socket(zmq.REP)
        zap.linger = 0
        zap.bind(ZAP_ENDPOINT)
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        monitors: dict[Any, str] = {}
        self._ready.set()
        try:
            while not self._halt.is_set():
                while not self._watch.empty():
                    address, endpoint = self._watch.get()
                    mon = self.ctx.socket(zmq.PAIR)
                    mon.linger = 0
                    mon.connect(address)
                    poller.register(mon, zmq.POLLIN)
                    monitors[mon] = endpoint
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is zap:
                        zap.send_multipart(self._reply(zap.recv_multipart()))
                    else:
                        self._failed(sock.recv_multipart(), monitors[sock])
        finally:
            for mon in monitors:
                mon.close(0)
            zap.close(0)

    def _reply(self, msg: list[bytes]) -> list[bytes]:
        """A ZAP (RFC 27) answer: 200 for the run's secret or an authorised key."""
        version, request_id = [*msg, b"", b""][:2]
        mechanism, credentials = (msg[5], msg[6:]) if len(msg) >= 6 else (b"", [])
        ok = False
        if mechanism == b"PLAIN" and len(credentials) == 2 and self.secret is not None:
            user, password = credentials
            ok = user == PLAIN_USER.encode() and hmac.compare_digest(password, self.secret.encode())
        elif mechanism == b"CURVE" and len(credentials) == 1:
            ok = z85.encode(credentials[0]) in self.curve_keys
        if ok:
            return [version, request_id, b"200", b"OK", mechanism.lower(), b""]
        return [version, request_id, b"400", b"not part of this run", b"", b""]

    def _failed(self, frames: list[bytes], endpoint: str) -> None:
        event = int.from_bytes(frames[0][:2], "little")
        reason = _FAILURES.get(event, f"event_{event}")
        with self._lock:
            self.refused[reason] += 1
            seen = self.refused[reason]
        if seen <= _LOGGED_PER_REASON:
            self.log.warning(
                "peer_refused", endpoint=endpoint, reason=reason, count=seen, time=time.time()
            )


class RefusalWatch:
    """The connecting side's view of `Gate`: the first handshake of `sock` that its server
    refused. libzmq does not retry such a connection, so the socket is left without a peer
    and a send on it waits for ever; this says why instead. Made before `sock` connects."""

    def __init__(self, ctx: Any, sock: Any) -> None:
        address = f"inproc://pipeline-refusals-{next(_counter)}"
        sock.monitor(address, _REFUSALS)
        self._sock = sock
        self._events = AsyncSocket(zmq.Socket(ctx, zmq.PAIR))
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.connect(address)

    async def refused(self) -> str:
        """Once the server refused the handshake: why, as the server's `Gate` counts it."""
        frames = await self._events.recv_multipart()
        return _FAILURES[int.from_bytes(frames[0][:2], "little")]

    def close(self) -> None:
        if self._events.closed:
            return
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._events.close(linger=0)
