"""Producer side of a queue: a ROUTER that sends only against credit and redelivers.

Consumers connect with DEALER sockets and grant credit. Every item stays in the
producer's in-flight table until its consumer acknowledges it; if that consumer dies
(process gone or silent past `peer_timeout_s`) the item goes back to the head of the
queue for another consumer. `send` waits while `max_pending` items are queued, so a
stalled consumer backs pressure up to whoever produces.

A consumer declared dead for its silence may only have been paused (SIGSTOP, a blocking
call): if it speaks again it is taken back with the credit it had, which it still counts as
granted and never grants again (`_departed`, like the control plane's).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pipeline.errors import SchemaMismatch, TransportClosed
from pipeline.log import get_logger
from pipeline.transport.channel import (
    ChannelConfig,
    ChannelStats,
    bind,
    cancel_and_wait,
    liveness_tick,
    make_async_socket,
    new_identity,
)
from pipeline.wire import codec
from pipeline.wire.messages import Credit, Heartbeat, MsgType

_CONTROL_TYPES = frozenset({MsgType.CREDIT, MsgType.ACK, MsgType.HEARTBEAT})
# consumers declared dead that are kept for their return; the oldest go first
_DEPARTED_KEPT = 1024


@dataclass(eq=False)
class _Item:
    uid: str
    frames: list[Any]
    acked: asyncio.Future[None]
    requeued: bool = False


@dataclass
class _Consumer:
    identity: bytes
    credit: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    inflight: dict[str, _Item] = field(default_factory=dict)


class QueueServer:
    def __init__(
        self,
        queue: str,
        endpoint: str,
        *,
        run_id: str,
        sender: str,
        config: ChannelConfig | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.queue = queue
        self.config = config or ChannelConfig()
        self.config.validate()
        self.run_id = run_id
        self.identity = new_identity(sender)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = make_async_socket(self._ctx, zmq.ROUTER)
        self.endpoint = bind(self._sock, endpoint)
        self._pending: collections.deque[_Item] = collections.deque()
        self._consumers: dict[bytes, _Consumer] = {}
        self._departed: dict[bytes, _Consumer] = {}  # declared dead; back if they speak
        self._by_uid: dict[str, _Item] = {}
        self._seq = 0
        self._space = asyncio.Condition()
        self._waiting = 0
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False
        self.stats = ChannelStats()
        self.log = get_logger("queue_server", queue=queue)

    # ------------------------------------------------------------------ public API

    def start(self) -> QueueServer:
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name=f"{self.queue}-recv"),
            asyncio.create_task(self._dispatch_loop(), name=f"{self.queue}-dispatch"),
            asyncio.create_task(self._liveness_loop(), name=f"{self.queue}-liveness"),
        ]
        return self

    async def send(
        self, body: Any, tensors: codec.TensorPack | None = None
    ) -> asyncio.Future[None]:
        """Queue one item; waits while the queue is full. Returns a future set on ack."""
        if self._closed:
            raise TransportClosed(f"queue {self.queue} is closed")
        if len(self._pending) >= self.config.max_pending:
            async with self._space:
                self._waiting += 1
                try:
                    await self._space.wait_for(lambda: len(self._pending) < self.config.max_pending)
                finally:
                    self._waiting -= 1
        self._seq += 1
        frames = codec.encode(
            body, run_id=self.run_id, sender=self.identity, seq=self._seq, tensors=tensors
        )
        uid = str(body.uid)
        existing = self._by_uid.get(uid)
        if existing is not None:
            return existing.acked  # already queued or in flight: one delivery per uid
        item = _Item(uid=uid, frames=frames, acked=asyncio.get_running_loop().create_future())
        self._by_uid[uid] = item
        self._pending.append(item)
        self._wakeup.set()
        return item.acked

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def inflight(self) -> int:
        return sum(len(c.inflight) for c in self._consumers.values())

    @property
    def unacked(self) -> int:
        return len(self._by_uid)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._tasks)
        for item in self._by_uid.values():
            if not item.acked.done():
                item.acked.cancel()
        self._sock.close(linger=0)

    # ------------------------------------------------------------------ internals

    async def _recv_loop(self) -> None:
        while True:
            try:
                await self._recv_one()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one message end the loop silently
                self.stats.rejected["internal_error"] += 1
                self.log.exception("receive_failed")

    async def _recv_one(self) -> None:
        frames = await self._sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        try:
            msg = codec.decode(
                frames[1:],
                allowed=_CONTROL_TYPES,
                limits=self.config.limits,
                run_id=self.run_id,
            )
        except SchemaMismatch as exc:
            self.stats.reject(self.log, exc.reason, exc.detail)
            return
        consumer = self._consumers.get(identity)
        if consumer is None:
            consumer = self._consumers[identity] = self._joined(identity)
        consumer.last_seen = time.monotonic()
        body = msg.body
        if isinstance(body, Credit):
            consumer.credit += max(0, body.credits)
            self._wakeup.set()
        elif isinstance(body, Heartbeat):
            pass
        else:  # Ack, maybe with credit
            for uid in body.uids:
                self._on_ack(uid)
            if body.credits > 0:
                consumer.credit += body.credits
                self._wakeup.set()

    def _joined(self, identity: bytes) -> _Consumer:
        name = identity.decode(errors="replace")
        consumer = self._departed.pop(identity, None)
        if consumer is None:
            self.log.info("consumer_joined", consumer=name)
            return _Consumer(identity=identity)
        # it was only silent (paused, or its loop blocked) and still counts that credit as
        # granted: exactly it while its connection stayed up, never less (items lost with a
        # dropped connection used credit here only). The items it held went back to the
        # queue; a copy that comes back to it is answered with fresh credit by its de-dup
        self.log.warning("consumer_back", consumer=name, credit=consumer.credit)
        if consumer.credit > 0:
            self._wakeup.set()
        return consumer

    def _on_ack(self, uid: str) -> None:
        item = self._by_uid.pop(uid, None)
        for consumer in self._consumers.values():
            consumer.inflight.pop(uid, None)
        if item is None:
            return
        self.stats.acked += 1
        if not item.acked.done():
            item.acked.set_result(None)
        # an acked item that was re-queued for redelivery must not go out again
        if item.requeued and item in self._pending:
            self._pending.remove(item)
            self._notify_space()

    def _notify_space(self) -> None:
        if not self._waiting:
            return

        async def _notify() -> None:
            async with self._space:
                self._space.notify_all()

        asyncio.get_running_loop().create_task(_notify())

    def _pick_consumer(self) -> _Consumer | None:
        best: _Consumer | None = None
        for consumer in self._consumers.values():
            if consumer.credit > 0 and (best is None or consumer.credit > best.credit):
                best = consumer
        return best

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            sent_any = False
            while self._pending:
                consumer = self._pick_consumer()
                if consumer is None:
                    break
                item = self._pending.popleft()
                try:
                    await self._sock.send_multipart([consumer.identity, *item.frames], copy=False)
                except zmq.ZMQError as exc:  # EHOSTUNREACH: the consumer is gone
                    self._pending.appendleft(item)
                    self._declare_dead(consumer, f"send failed: {exc}")
                    continue
                consumer.credit -= 1
                consumer.inflight[item.uid] = item
                self.stats.sent += 1
                sent_any = True
            if sent_any:
                self._notify_space()

    def _declare_dead(self, consumer: _Consumer, reason: str) -> None:
        self._consumers.pop(consumer.identity, None)
        self._departed[consumer.identity] = consumer
        if len(self._departed) > _DEPARTED_KEPT:
            del self._departed[next(iter(self._departed))]
        self.stats.dead_peers += 1
        items = [i for i in consumer.inflight.values() if i.uid in self._by_uid]
        consumer.inflight = {}
        self.stats.redelivered += len(items)
        for item in reversed(items):
            item.requeued = True
            self._pending.appendleft(item)
        self.log.warning(
            "consumer_dead",
            consumer=consumer.identity.decode(errors="replace"),
            reason=reason,
            requeued=len(items),
        )
        self._wakeup.set()

    async def _liveness_loop(self) -> None:
        seq = 0
        while True:
            now = await liveness_tick(self.config.heartbeat_s, self._consumers.values)
            for consumer in list(self._consumers.values()):
                if now - consumer.last_seen > self.config.peer_timeout_s:
                    self._declare_dead(consumer, f"silent for {now - consumer.last_seen:.1f}s")
                    continue
                seq += 1
                frames = codec.encode(
                    Heartbeat(service=self.queue, backlog=len(self._pending)),
                    run_id=self.run_id,
                    sender=self.identity,
                    seq=seq,
                )
                try:
                    await self._sock.send_multipart([consumer.identity, *frames])
                except zmq.ZMQError as exc:
                    self._declare_dead(consumer, f"heartbeat failed: {exc}")
