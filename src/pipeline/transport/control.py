"""The control plane: handshake (hello -> config -> ready), heartbeats, step reports.

Small messages only. The controller binds a ROUTER; every service connects a DEALER,
says hello within a time limit and from then on heartbeats both ways make a dead peer
visible as a typed error instead of a silent hang.

A restarted controller (a new incarnation at the same address, same run id) does not know
the services that were already running: it answers whatever they send with a heartbeat,
the service sees a new sender and says hello again (`ControlClient.rejoins` counts that).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pipeline.errors import HandshakeRefused, HandshakeTimeout, SchemaMismatch
from pipeline.log import get_logger
from pipeline.transport.auth import RefusalWatch
from pipeline.transport.channel import (
    ChannelConfig,
    ChannelStats,
    bind,
    cancel_and_wait,
    connect,
    guarded,
    liveness_tick,
    make_async_socket,
    new_identity,
)
from pipeline.wire import codec
from pipeline.wire.messages import ConfigMsg, Heartbeat, Hello, MsgType, Ready, Shutdown

_TO_CONTROLLER = frozenset(
    {
        MsgType.HELLO,
        MsgType.READY,
        MsgType.HEARTBEAT,
        MsgType.STEP_DONE,
        MsgType.DROPPED,
        MsgType.METRICS,
        MsgType.ERROR,
        MsgType.WEIGHT_DONE,
    }
)
_TO_SERVICE = frozenset({MsgType.CONFIG, MsgType.HEARTBEAT, MsgType.SHUTDOWN})


@dataclass
class Peer:
    identity: bytes
    hello: Hello
    ready: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    policy_version: int = -1

    @property
    def name(self) -> str:
        return f"{self.hello.service}-{self.hello.replica}"


@dataclass
class PeerEvent:
    """What the controller's inbox yields besides data messages."""

    kind: str  # "joined" | "ready" | "dead" | "back" (a dead-declared peer spoke again)
    peer: Peer


class ControlServer:
    def __init__(
        self,
        endpoint: str,
        *,
        run_id: str,
        config_for: Callable[[Hello], ConfigMsg],
        config: ChannelConfig | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.run_id = run_id
        self.config = config or ChannelConfig()
        self.identity = new_identity("controller")
        self._config_for = config_for
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = make_async_socket(self._ctx, zmq.ROUTER)
        self.endpoint = bind(self._sock, endpoint)
        self.peers: dict[bytes, Peer] = {}
        self._departed: dict[bytes, Peer] = {}  # declared dead; back if they speak again
        self._asked: dict[bytes, float] = {}  # unknown peers last asked to say hello
        # the learner's version, echoed in every heartbeat answer
        self.policy_version = 0
        self.inbox: asyncio.Queue[tuple[Peer, Any] | PeerEvent] = asyncio.Queue()
        self.stats = ChannelStats()
        self._seq = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False
        self.log = get_logger("control_server")

    def start(self) -> ControlServer:
        self._tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._liveness_loop()),
        ]
        return self

    async def send(self, peer: Peer, body: Any) -> None:
        await self._send_to(peer.identity, body, peer.name)

    async def _send_to(self, identity: bytes, body: Any, name: str) -> None:
        self._seq += 1
        frames = codec.encode(body, run_id=self.run_id, sender=self.identity, seq=self._seq)
        try:
            await self._sock.send_multipart([identity, *frames])
        except zmq.ZMQError as exc:
            self.log.warning("send_failed", peer=name, error=str(exc))

    async def broadcast(self, body: Any) -> list[str]:
        """Send `body` to every peer; returns their names."""
        peers = list(self.peers.values())
        if isinstance(body, Shutdown):  # a peer paused past the timeout must hear the end too
            peers += list(self._departed.values())
        for peer in peers:
            await self.send(peer, body)
        return [peer.name for peer in peers]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._tasks)
        self._sock.close(linger=0)

    async def _recv_loop(self) -> None:
        await guarded(self._recv_one, self.log, self.stats)

    async def _recv_one(self) -> None:
        frames = await self._sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        try:
            msg = codec.decode(frames[1:], allowed=_TO_CONTROLLER, run_id=None)
        except SchemaMismatch as exc:
            self.stats.reject(self.log, exc.reason, exc.detail)
            return
        body = msg.body
        peer: Peer | None
        if isinstance(body, Hello):
            self._asked.pop(identity, None)
            known = self.peers.get(identity)
            peer = self.peers[identity] = Peer(
                identity=identity, hello=body, ready=known is not None and known.ready
            )
            self.log.info("peer_hello", peer=peer.name, pid=body.pid)
            await self.send(peer, self._config_for(body))
            self.inbox.put_nowait(PeerEvent("joined", peer))
            return
        peer = self.peers.get(identity)
        if peer is None and identity in self._departed:
            # declared dead while it was only busy (a long stall): take it back as it was
            peer = self.peers[identity] = self._departed.pop(identity)
            self.log.warning("peer_back", peer=peer.name)
            self.inbox.put_nowait(PeerEvent("back", peer))
        if peer is None:
            self.stats.rejected["no_hello"] += 1
            now = time.monotonic()
            # heartbeats queued while no controller was up arrive in a burst: answer once
            if now - self._asked.get(identity, -1e9) < self.config.peer_timeout_s / 2:
                return
            self._asked[identity] = now
            self.log.warning(
                "message_before_hello",
                type=msg.type.name,
                hint="a service that joined an earlier controller incarnation says hello again",
            )
            # our heartbeat tells it that the controller changed (a new sender)
            beat = Heartbeat(service="controller", policy_version=self.policy_version)
            await self._send_to(identity, beat, identity.decode(errors="replace"))
            return
        peer.last_seen = time.monotonic()
        if isinstance(body, Ready):
            peer.ready = True
            self.inbox.put_nowait(PeerEvent("ready", peer))
        elif isinstance(body, Heartbeat):
            peer.policy_version = body.policy_version
            await self.send(
                peer, Heartbeat(service="controller", policy_version=self.policy_version)
            )
        else:
            self.stats.received += 1
            self.inbox.put_nowait((peer, body))

    async def _liveness_loop(self) -> None:
        while True:
            now = await liveness_tick(self.config.heartbeat_s, self.peers.values)
            for identity, peer in list(self.peers.items()):
                if now - peer.last_seen > self.config.peer_timeout_s:
                    del self.peers[identity]
                    self._departed[identity] = peer
                    self.stats.dead_peers += 1
                    self.log.warning(
                        "peer_dead", peer=peer.name, silent_s=round(now - peer.last_seen, 1)
                    )
                    self.inbox.put_nowait(PeerEvent("dead", peer))


class ControlClient:
    def __init__(
        self,
        endpoint: str,
        *,
        service: str,
        replica: int,
        config: ChannelConfig | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.service = service
        self.replica = replica
        self.config = config or ChannelConfig()
        self.identity = new_identity(f"{service}-{replica}")
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = make_async_socket(self._ctx, zmq.DEALER, identity=self.identity)
        self._refusals = RefusalWatch(self._ctx, self._sock)
        connect(self._sock, endpoint)
        self.run_id = ""
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.stats = ChannelStats()
        self.shutdown = asyncio.Event()
        self.controller_dead = asyncio.Event()
        self.policy_version = -1
        # the learner version the controller last announced: it journals a step before it
        # announces its version, so this acknowledges the learner's StepDone reports
        self.controller_version = -1
        # hellos answered by a new controller incarnation (a restarted controller)
        self.rejoins = 0
        self._controller = ""  # the sender name of the controller incarnation we know
        self._hello: Hello | None = None
        self._hello_sent_at: float | None = None  # a re-hello not answered yet
        self._last_seen = time.monotonic()
        self._seq = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False
        self.log = get_logger("control_client")

    async def send(self, body: Any) -> None:
        self._seq += 1
        frames = codec.encode(body, run_id=self.run_id, sender=self.identity, seq=self._seq)
        await self._sock.send_multipart(frames)

    async def handshake(self, hello: Hello, timeout_s: float) -> ConfigMsg:
        """hello -> config -> ready, within `timeout_s`; then heartbeats start."""
        answer = asyncio.ensure_future(self._handshake(hello))
        refusal = asyncio.ensure_future(self._refusals.refused())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait((answer, refusal), return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise HandshakeTimeout(
                f"controller at {self.endpoint} did not answer hello within {timeout_s}s; "
                "is the controller running, is --controller the right address, and across "
                "hosts, does this host have the run's keys (run.keys_dir)?"
            ) from None
        finally:
            await cancel_and_wait([t for t in (answer, refusal) if not t.done()])
            self._refusals.close()
        if not answer.cancelled():  # answered (or failed) first
            return answer.result()
        raise HandshakeRefused(
            f"controller at {self.endpoint} refused this service's connection "
            f"({refusal.result()}): across hosts, set run.keys_dir to a copy of the run's "
            "keys (`pipeline keys`, with authorized/); on the controller's host, start it "
            "with the run's profile so it reads the run's secret"
        )

    async def _handshake(self, hello: Hello) -> ConfigMsg:
        self._hello = hello
        # a controller that refused this connection leaves the socket without a peer, and
        # this send waits: the refusal or the time limit ends it
        await self.send(hello)
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = codec.decode(frames, allowed=_TO_SERVICE)
            except SchemaMismatch as exc:
                self.stats.reject(self.log, exc.reason, exc.detail)
                continue
            if isinstance(msg.body, ConfigMsg):
                self.run_id = msg.body.run_id
                self.policy_version = msg.body.policy_version
                self.controller_version = msg.body.policy_version
                self._controller = msg.header.sender
                await self.send(Ready(service=self.service, replica=self.replica))
                self._last_seen = time.monotonic()
                self._tasks = [
                    asyncio.create_task(self._recv_loop()),
                    asyncio.create_task(self._liveness_loop()),
                ]
                return msg.body

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._tasks)
        self._refusals.close()
        self._sock.close(linger=0)

    async def _recv_loop(self) -> None:
        await guarded(self._recv_one, self.log, self.stats)

    async def _recv_one(self) -> None:
        frames = await self._sock.recv_multipart(copy=False)
        try:
            msg = codec.decode(frames, allowed=_TO_SERVICE, run_id=self.run_id)
        except SchemaMismatch as exc:
            self.stats.reject(self.log, exc.reason, exc.detail)
            return
        self._last_seen = time.monotonic()
        if self.controller_dead.is_set():
            self.controller_dead.clear()
            self.log.info("controller_back")
        if isinstance(msg.body, ConfigMsg):
            await self._rejoined(msg.header.sender, msg.body)
            return
        if msg.header.sender != self._controller and self._hello_sent_at is None:
            self.log.warning("controller_restarted", controller=msg.header.sender)
            await self._say_hello()
        if isinstance(msg.body, Heartbeat):
            # the controller's heartbeats carry the learner's current policy version
            self.policy_version = max(self.policy_version, msg.body.policy_version)
            if msg.header.sender == self._controller:
                self.controller_version = msg.body.policy_version
        if isinstance(msg.body, Shutdown):
            self.log.info("shutdown_requested", reason=msg.body.reason)
            self.shutdown.set()
        elif not isinstance(msg.body, Heartbeat):
            self.inbox.put_nowait(msg.body)

    async def _say_hello(self) -> None:
        assert self._hello is not None, "handshake() first"
        self._hello_sent_at = time.monotonic()
        await self.send(self._hello)

    async def _rejoined(self, sender: str, config: ConfigMsg) -> None:
        """A new controller incarnation answered our hello: ready again, same run."""
        if self._hello_sent_at is None:
            return  # a duplicate answer
        self._hello_sent_at = None
        self._controller = sender
        self.controller_version = config.policy_version
        self.policy_version = max(self.policy_version, config.policy_version)
        await self.send(Ready(service=self.service, replica=self.replica))
        self.rejoins += 1
        self.log.info(
            "controller_rejoined", controller=sender, policy_version=config.policy_version
        )

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            sent_at = self._hello_sent_at
            if sent_at is not None and time.monotonic() - sent_at > self.config.peer_timeout_s / 2:
                await self._say_hello()  # that hello or its answer was lost with a controller
            await self.send(
                Heartbeat(
                    service=self.service, replica=self.replica, policy_version=self.policy_version
                )
            )
            silent = time.monotonic() - self._last_seen
            if silent > self.config.peer_timeout_s and not self.controller_dead.is_set():
                self.controller_dead.set()
                self.log.warning("controller_silent", silent_s=round(silent, 1))
