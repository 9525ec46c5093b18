"""The weight-sync control channel: one ROUTER at learner rank 0, one DEALER per engine rank.

Project messages travel as themselves (`Hello` to register, `WeightMeta`, `WeightDone`),
the control structs of `pipeline.wire.weights` inside a `WeightControl`. Sockets are
synchronous: the learner publishes from its training loop and the engine receives in its
own thread, and both block on collectives anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from pipeline.errors import SchemaMismatch
from pipeline.log import get_logger
from pipeline.transport.channel import ChannelStats, make_socket
from pipeline.wire import codec
from pipeline.wire.messages import MsgType, WeightControl
from pipeline.wire.weights import Control

# an engine's Shutdown tells the learner it is leaving (no weights for it any more)
TO_LEARNER = frozenset(
    {MsgType.HELLO, MsgType.WEIGHT_DONE, MsgType.WEIGHT_CONTROL, MsgType.SHUTDOWN}
)
TO_ENGINE = frozenset({MsgType.WEIGHT_CONTROL, MsgType.WEIGHT_META, MsgType.SHUTDOWN})


def wrap(ctl: Control) -> WeightControl:
    return WeightControl(ctl=ctl)


def unwrap(body: Any) -> Control | None:
    """The control struct of a WeightControl; None for any other message."""
    return body.ctl if isinstance(body, WeightControl) else None


@dataclass
class Received:
    identity: bytes  # b"" on the engine side
    message: codec.Message
    control: Control | None


class Link:
    """A control socket with codec framing, sequence numbers and deadline-based receive."""

    def __init__(
        self, ctx: zmq.Context, kind: int, *, sender: str, run_id: str = "", identity: str = ""
    ) -> None:
        self.sock = make_socket(ctx, kind, identity or None)
        if kind == zmq.ROUTER:
            # a restarted engine reuses its name: the newest connection wins
            self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.kind = kind
        self.sender = sender
        self.run_id = run_id
        self.seq = 0
        self.allowed = TO_LEARNER if kind == zmq.ROUTER else TO_ENGINE
        self.stats = ChannelStats()  # refused messages, counted and logged (rate-limited)
        self.log = get_logger("weights.link", sender=sender)

    def send(self, body: Any, identity: bytes = b"") -> int:
        """Send a project message or a control struct; its header seq, or 0 when the peer
        is not connected (any more)."""
        if not isinstance(body, msgspec.Struct) or not hasattr(body, "TYPE"):
            body = wrap(body)
        self.seq += 1
        frames = codec.encode(body, run_id=self.run_id, sender=self.sender, seq=self.seq)
        try:
            # never waits: SNDHWM is unbounded, so EAGAIN means a DEALER without a peer (its
            # connection refused, which libzmq does not retry)
            if self.kind == zmq.ROUTER:
                self.sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            else:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # EHOSTUNREACH, EAGAIN: that peer is not connected (any more)
            return 0
        return self.seq

    def recv(self, timeout_s: float) -> Received | None:
        """Next valid message within timeout_s (malformed ones are counted and skipped)."""
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self.sock.recv_multipart(copy=False)
        identity = b""
        if self.kind == zmq.ROUTER:
            identity, frames = bytes(frames[0].buffer), frames[1:]
        try:
            msg = codec.decode(frames, allowed=self.allowed, run_id=self.run_id or None)
            return Received(identity, msg, unwrap(msg.body))
        except SchemaMismatch as exc:
            self.stats.reject(self.log, exc.reason, exc.detail)
            return None

    @property
    def rejected(self) -> int:
        """Messages refused so far."""
        return sum(self.stats.rejected.values())

    def close(self) -> None:
        self.sock.close(linger=0)
