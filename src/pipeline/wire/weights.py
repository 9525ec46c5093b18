"""The weight-sync control channel: one ROUTER at learner rank 0, one DEALER per engine rank.

Project messages travel as themselves (`Hello` to register, `WeightMeta`, `WeightDone`).
The few control messages that `messages.py` has no type for (group assignment, meta
accepted, go/abort, CUDA IPC handles, bucket ready/free) are local msgspec structs carried
as JSON inside a `ConfigMsg` whose `run_dir` is `CONTROL_TAG`; no pickle anywhere.
Sockets are synchronous: the learner publishes from its training loop and the engine
receives in its own thread, and both block on collectives anyway.
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
from pipeline.wire.messages import ConfigMsg, MsgType

CONTROL_TAG = "weights-control"
# an engine's Shutdown tells the learner it is leaving (no weights for it any more)
TO_LEARNER = frozenset({MsgType.HELLO, MsgType.WEIGHT_DONE, MsgType.CONFIG, MsgType.SHUTDOWN})
TO_ENGINE = frozenset({MsgType.CONFIG, MsgType.WEIGHT_META, MsgType.SHUTDOWN})


class _Ctl(msgspec.Struct, kw_only=True, tag_field="kind"):
    pass


class GroupAssign(_Ctl, tag="group"):
    """Join weight group `generation` as `rank` (rank 0.. senders-1 are learner ranks)."""

    generation: int
    rank: int
    world: int
    senders: int
    members: list[str]  # member name per rank, for error messages
    backend: str  # gloo | nccl | cuda_ipc
    store_host: str
    store_port: int
    timeout_s: float  # per collective (the bucket phase deadline)
    rendezvous_s: float  # waiting for every member to arrive


class Dropped(_Ctl, tag="dropped"):
    """The learner removed this engine; `rejoin` says whether to register again."""

    reason: str
    rejoin: bool = True


class MetaAccepted(_Ctl, tag="accepted"):
    """The engine validated the metadata of `attempt` (the WeightMeta header's seq)."""

    version: int
    attempt: int


class MetaRejected(_Ctl, tag="rejected"):
    """The engine refused the metadata; `problems` lists the offending names per kind."""

    version: int
    attempt: int
    error: str
    problems: dict[str, list[str]] = {}


class SyncGo(_Ctl, tag="go"):
    """After every engine answered the metadata: move the bytes, or abort this version."""

    version: int
    attempt: int
    proceed: bool
    reason: str = ""


class IpcHandle(msgspec.Struct, array_like=True):
    """The fields of `torch.multiprocessing.reductions.reduce_tensor` for a CUDA buffer."""

    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcBuffers(_Ctl, tag="ipc_buffers"):
    generation: int
    slots: list[IpcHandle]


class BucketReady(_Ctl, tag="bucket_ready"):
    version: int
    bucket: int
    slot: int
    nbytes: int


class BucketFree(_Ctl, tag="bucket_free"):
    version: int
    bucket: int
    slot: int


class Pause(_Ctl, tag="pause"):
    """The learner starts the step that ends with `version`: an engine taking turns with it
    on one device stops decoding until that version's weights are applied."""

    version: int


Control = (
    GroupAssign
    | Dropped
    | MetaAccepted
    | MetaRejected
    | SyncGo
    | IpcBuffers
    | BucketReady
    | BucketFree
    | Pause
)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Control)


def wrap(ctl: Control, run_id: str) -> ConfigMsg:
    return ConfigMsg(run_id=run_id, run_dir=CONTROL_TAG, config_json=_encoder.encode(ctl).decode())


def unwrap(body: Any) -> Control | None:
    """The control struct in a ConfigMsg envelope; None for any other message."""
    if not isinstance(body, ConfigMsg) or body.run_dir != CONTROL_TAG:
        return None
    try:
        return _decoder.decode(body.config_json)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaMismatch("malformed", f"weight control message: {exc}") from None


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
            body = wrap(body, self.run_id)
        self.seq += 1
        frames = codec.encode(body, run_id=self.run_id, sender=self.sender, seq=self.seq)
        try:
            if self.kind == zmq.ROUTER:
                self.sock.send_multipart([identity, *frames], copy=False)
            else:
                self.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError:  # EHOSTUNREACH: that identity is not connected (any more)
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
