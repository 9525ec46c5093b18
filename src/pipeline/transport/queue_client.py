"""Consumer side of a queue: DEALERs to every producer, credit, acks and de-duplication.

The consumer grants each producer `prefetch` credits and returns one each time the
application takes an item. Items are de-duplicated by `uid`: a uid already done is
acknowledged again without surfacing (its first ack may have been lost with a dead
producer or consumer); a uid still in progress is acknowledged when it finishes.

No credit goes out before `start`: a service starts its input once its setup is done, so
no item waits on a replica still loading (and silent while it blocks its loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pipeline.errors import SchemaMismatch, TransportClosed
from pipeline.log import get_logger
from pipeline.transport.auth import RefusalWatch
from pipeline.transport.channel import (
    ChannelConfig,
    ChannelStats,
    cancel_and_wait,
    connect,
    liveness_tick,
    make_async_socket,
    new_identity,
)
from pipeline.wire import codec
from pipeline.wire.messages import QUEUE_TYPES, Ack, Credit, Heartbeat, MsgType


@dataclass
class _Producer:
    endpoint: str
    sock: Any
    refusals: RefusalWatch
    refused: str = ""  # why the producer refused our connection (then nothing goes to it)
    incarnation: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    outstanding: int = 0  # credit granted and not yet used
    owed: int = 0  # credit earned back by taken items, not yet granted
    acks: list[str] = field(default_factory=list)  # acks not yet sent


@dataclass
class Delivery:
    """One received item. Call `ack()` once its processing (and hand-off) is complete."""

    uid: str
    message: codec.Message
    _client: QueueClient
    _producers: list[_Producer]

    @property
    def body(self) -> Any:
        return self.message.body

    def ack(self) -> None:
        self._client._ack(self)


class QueueClient:
    def __init__(
        self,
        queue: str,
        endpoints: Iterable[str],
        *,
        run_id: str,
        consumer: str,
        config: ChannelConfig | None = None,
        ctx: zmq.asyncio.Context | None = None,
        allowed: frozenset[MsgType] | None = None,
        recorder: Any = None,
    ) -> None:
        self.queue = queue
        self.config = config or ChannelConfig()
        self.config.validate()
        self.run_id = run_id
        self.identity = new_identity(consumer)
        self.allowed = allowed or QUEUE_TYPES.get(queue)
        self.recorder = recorder
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._producers: list[_Producer] = []
        self._buffer: asyncio.Queue[Delivery] = asyncio.Queue()
        self._done: set[str] = set()
        self._in_progress: dict[str, Delivery] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._seq = 0
        self._closed = False
        self._started = False
        self._flush_scheduled = False
        self._aux: set[asyncio.Task[Any]] = set()
        self.stats = ChannelStats()
        self.log = get_logger("queue_client", queue=queue)
        for endpoint in endpoints:
            self._add(endpoint)

    def _add(self, endpoint: str) -> _Producer:
        sock = make_async_socket(self._ctx, zmq.DEALER, identity=self.identity)
        refusals = RefusalWatch(self._ctx, sock)
        connect(sock, endpoint)
        producer = _Producer(endpoint=endpoint, sock=sock, refusals=refusals)
        self._producers.append(producer)
        return producer

    # ------------------------------------------------------------------ public API

    async def start(self) -> QueueClient:
        if self._started:
            return self
        self._started = True
        for producer in self._producers:
            self._tasks.append(asyncio.create_task(self._watch(producer)))
            await self._grant(producer, self.config.prefetch)
            self._tasks.append(asyncio.create_task(self._recv_loop(producer)))
        self._tasks.append(asyncio.create_task(self._liveness_loop()))
        return self

    async def connect(self, endpoint: str) -> None:
        """Add a producer (a replica that joined the run)."""
        if any(p.endpoint == endpoint for p in self._producers):
            return
        producer = self._add(endpoint)
        if not self._started:
            return  # `start` grants its credit with the others'
        self._tasks.append(asyncio.create_task(self._watch(producer)))
        await self._grant(producer, self.config.prefetch)
        self._tasks.append(asyncio.create_task(self._recv_loop(producer)))

    async def get(self, timeout: float | None = None) -> Delivery:
        if self._closed:
            raise TransportClosed(f"queue {self.queue} is closed")
        delivery = await asyncio.wait_for(self._buffer.get(), timeout)
        # the credit goes back with this tick's acks, in one message per producer
        delivery._producers[0].owed += 1
        self._schedule()
        return delivery

    def mark_done(self, uids: Iterable[str]) -> None:
        """Seed the de-duplication set (e.g. uids a restored checkpoint already holds)."""
        self._done.update(uids)

    @property
    def buffered(self) -> int:
        return self._buffer.qsize()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._tasks)
        for producer in self._producers:
            producer.refusals.close()
            producer.sock.close(linger=0)

    # ------------------------------------------------------------------ internals

    async def _send(self, producer: _Producer, body: Any) -> None:
        if self._closed or producer.refused:
            return
        self._seq += 1
        frames = codec.encode(body, run_id=self.run_id, sender=self.identity, seq=self._seq)
        try:
            await producer.sock.send_multipart(frames)
        except zmq.ZMQError:
            if not producer.refused:  # a send the refusal woke (its socket closed)
                raise

    async def _watch(self, producer: _Producer) -> None:
        """A producer that refused our connection gets nothing more: libzmq does not retry
        it, so a send to it would wait for a peer for ever."""
        producer.refused = await producer.refusals.refused()
        producer.alive = False
        self.log.error(
            "producer_refused",
            endpoint=producer.endpoint,
            reason=producer.refused,
            fix="this host needs the run's keys (run.keys_dir, with authorized/) as the "
            "producer's host has them",
        )
        producer.refusals.close()
        producer.sock.close(linger=0)  # wakes a send waiting on it

    async def _grant(self, producer: _Producer, credits: int) -> None:
        producer.outstanding += credits
        await self._send(
            producer, Credit(queue=self.queue, credits=credits, consumer=self.identity)
        )

    def _ack(self, delivery: Delivery) -> None:
        if self._in_progress.pop(delivery.uid, None) is None and delivery.uid in self._done:
            return
        self._done.add(delivery.uid)
        self.stats.acked += 1
        for producer in delivery._producers:
            producer.acks.append(delivery.uid)
        self._schedule()

    def _schedule(self) -> None:
        """One Ack message per producer per loop tick, whatever the number acked or taken."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._schedule_flush)

    def _schedule_flush(self) -> None:
        self._flush_scheduled = False
        task = asyncio.get_running_loop().create_task(self._flush_acks())
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    async def _flush_acks(self) -> None:
        for producer in self._producers:
            if producer.acks or producer.owed:
                uids, producer.acks = producer.acks, []
                credits, producer.owed = producer.owed, 0
                producer.outstanding += credits
                await self._send(producer, Ack(queue=self.queue, uids=uids, credits=credits))

    async def _recv_loop(self, producer: _Producer) -> None:
        while not producer.refused:
            try:
                await self._recv_one(producer)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one message end the loop silently
                if producer.refused:  # its socket closed under the receive
                    return
                self.stats.rejected["internal_error"] += 1
                self.log.exception("receive_failed", endpoint=producer.endpoint)

    async def _recv_one(self, producer: _Producer) -> None:
        frames = await producer.sock.recv_multipart(copy=False)
        producer.last_seen = time.monotonic()
        try:
            msg = codec.decode(
                frames,
                allowed=(self.allowed or frozenset()) | {MsgType.HEARTBEAT},
                limits=self.config.limits,
                run_id=self.run_id,
            )
        except SchemaMismatch as exc:
            self.stats.reject(self.log, exc.reason, exc.detail)
            return
        if msg.header.sender != producer.incarnation:
            if producer.incarnation:
                # the producer restarted and forgot our credit: grant it afresh
                self.log.info("producer_restarted", endpoint=producer.endpoint)
                producer.outstanding = producer.owed = 0
                await self._grant(producer, max(1, self.config.prefetch - self._buffer.qsize()))
            producer.incarnation = msg.header.sender
        if not producer.alive:
            producer.alive = True
            self.log.info("producer_back", endpoint=producer.endpoint)
        if isinstance(msg.body, Heartbeat):
            await self._send(producer, Heartbeat(service=self.queue, backlog=self.buffered))
            return
        self.stats.received += 1
        producer.outstanding = max(0, producer.outstanding - 1)
        self._on_item(producer, msg)

    def _on_item(self, producer: _Producer, msg: codec.Message) -> None:
        uid = str(msg.body.uid)
        if uid in self._done:
            self.stats.duplicates += 1
            asyncio.get_running_loop().create_task(self._redo_ack(producer, uid))
            return
        running = self._in_progress.get(uid)
        if running is not None:
            self.stats.duplicates += 1
            running._producers.append(producer)  # ack this one too when it finishes
            asyncio.get_running_loop().create_task(self._grant(producer, 1))
            return
        delivery = Delivery(uid=uid, message=msg, _client=self, _producers=[producer])
        self._in_progress[uid] = delivery
        if self.recorder is not None:
            self.recorder.write(msg.frames)
        self._buffer.put_nowait(delivery)

    async def _redo_ack(self, producer: _Producer, uid: str) -> None:
        await self._send(producer, Ack(queue=self.queue, uids=[uid]))
        await self._grant(producer, 1)

    async def _liveness_loop(self) -> None:
        while True:
            now = await liveness_tick(self.config.heartbeat_s, lambda: self._producers)
            for producer in self._producers:
                silent = now - producer.last_seen
                if producer.alive and silent > self.config.peer_timeout_s:
                    producer.alive = False
                    self.stats.dead_peers += 1
                    self.log.warning(
                        "producer_silent", endpoint=producer.endpoint, silent_s=round(silent, 1)
                    )
                if producer.owed:
                    owed, producer.owed = producer.owed, 0
                    await self._grant(producer, owed)
                # heartbeats keep us known to the producer (and re-register after its restart)
                await self._send(producer, Heartbeat(service=self.queue, backlog=self.buffered))
