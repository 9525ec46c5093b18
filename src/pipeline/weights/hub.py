"""Learner rank 0's side of the control channel: engine registry, store host, replies.

Engines register with `Hello` (service = member name, e.g. "engine-1.tp0"). A member stays
until the learner drops it (it did not answer in time, or refused the metadata); a
restarted engine registers again under the same name from a new socket identity, which
replaces the old incarnation. Any membership change makes the next publish rebuild the
weight group under a new generation.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq

from pipeline.log import get_logger
from pipeline.transport.channel import bind
from pipeline.transport.security import release
from pipeline.weights.control import Link, Received
from pipeline.weights.group import StoreHost
from pipeline.wire.messages import Hello, Shutdown
from pipeline.wire.weights import Removed

log = get_logger("weights.hub")


@dataclass
class Member:
    name: str
    identity: bytes
    replica: int
    pid: int
    host: str
    since: float = field(default_factory=time.monotonic)
    tp_rank: int = 0
    tp_size: int = 1


def _replica_of(member: Member) -> tuple[str, int]:
    """The engine replica a member is a rank of ("rollout-0" of "rollout-0.tp1"), with its
    TP size."""
    base = member.name.rpartition(".tp")[0] if member.tp_size > 1 else member.name
    return base, member.tp_size


# a reply handler: (member name, message) -> True when it is that member's answer
OnReply = Callable[[str, Received], bool]


class WeightHub:
    """Binds the control ROUTER and hosts the rendezvous store (learner rank 0 only)."""

    def __init__(
        self,
        *,
        endpoint: str = "tcp://127.0.0.1:0",
        store_host: str = "127.0.0.1",
        store_port: int = 0,
        run_id: str = "",
    ) -> None:
        self.ctx = zmq.Context()
        self.link = Link(self.ctx, zmq.ROUTER, sender="learner", run_id=run_id)
        self.endpoint = bind(self.link.sock, endpoint)
        self.store = StoreHost(store_host, store_port)
        self.members: dict[str, Member] = {}
        self.changed = False  # membership differs from the current weight group
        self.generation = 0
        self._unread: deque[tuple[str | None, Received]] = deque()

    # ------------------------------------------------------------------ registry

    def layout(self, name: str) -> tuple[int, int]:
        """(tp_rank, tp_size) of a member's shards: (0, 1) for a whole-model engine."""
        member = self.members[name]
        return member.tp_rank, member.tp_size

    def names(self) -> list[str]:
        """The members a weight group takes: whole-model engines, and the ranks of a
        tensor-parallel replica once all of its ranks have registered (a replica's ranks
        apply a version together: one alone in the group would wait for the others)."""
        ranks: dict[tuple[str, int], set[int]] = {}
        for m in self.members.values():
            ranks.setdefault(_replica_of(m), set()).add(m.tp_rank)
        complete = [
            m for m in self.members.values() if ranks[_replica_of(m)] == set(range(m.tp_size))
        ]
        return [m.name for m in sorted(complete, key=lambda m: (m.replica, m.name))]

    def _register(self, rcv: Received) -> str | None:
        """Record a Hello; returns the name when it replaced a live member's incarnation."""
        hello: Hello = rcv.message.body
        old = self.members.get(hello.service)
        if old is not None and old.identity == rcv.identity:
            return None  # a repeated hello from the same incarnation
        self.members[hello.service] = Member(
            hello.service,
            rcv.identity,
            hello.replica,
            hello.pid,
            hello.host,
            tp_rank=hello.tp_rank,
            tp_size=hello.tp_size,
        )
        self.changed = True
        log.info("engine_registered", engine=hello.service, pid=hello.pid, host=hello.host)
        return hello.service if old is not None else None

    def drop(self, name: str, reason: str, *, rejoin: bool = True) -> None:
        member = self.members.pop(name, None)
        if member is None:
            return
        self.changed = True
        self.link.send(Removed(reason=reason, rejoin=rejoin), member.identity)
        log.warning("engine_dropped", engine=name, reason=reason, rejoin=rejoin)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Take registrations; discard stale replies of earlier syncs."""
        self._unread.clear()
        deadline = time.monotonic() + timeout_s
        while True:
            rcv = self.link.recv(max(0.0, deadline - time.monotonic()))
            if rcv is None:
                return
            if isinstance(rcv.message.body, Hello):
                self._register(rcv)
            elif isinstance(rcv.message.body, Shutdown):
                self._leave(rcv)

    def _leave(self, rcv: Received) -> str | None:
        """An engine said goodbye: forget it (the next publish rebuilds the group)."""
        name = self._name_of(rcv.identity)
        if name is not None:
            del self.members[name]
            self.changed = True
            log.info("engine_left", engine=name)
        return name

    def wait_for_members(self, count: int, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(self.members) < count and time.monotonic() < deadline:
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.names()

    # ------------------------------------------------------------------ messaging

    def send(self, name: str, body: object) -> int:
        """Header seq of the sent message, 0 when that engine is not connected."""
        member = self.members.get(name)
        return 0 if member is None else self.link.send(body, member.identity)

    def next_reply(self, timeout_s: float) -> tuple[str | None, Received] | None:
        """The next message with the member it came from. A Hello registers (its name is
        returned only when it replaced a live incarnation: that member restarted)."""
        if self._unread:
            return self._unread.popleft()
        rcv = self.link.recv(max(0.0, timeout_s))
        if rcv is None:
            return None
        if isinstance(rcv.message.body, Hello):
            return self._register(rcv), rcv
        if isinstance(rcv.message.body, Shutdown):
            return self._leave(rcv), rcv
        return self._name_of(rcv.identity), rcv

    def unread(self, replies: list[tuple[str | None, Received]]) -> None:
        """Put replies back, in order, for the next reader (e.g. a WeightDone that arrived
        while the CUDA IPC sender was waiting for its slots to be freed)."""
        self._unread.extendleft(reversed(replies))

    def collect(self, names: Iterable[str], timeout_s: float, on_reply: OnReply) -> set[str]:
        """Wait until each named member answered (per `on_reply`) or the deadline; returns
        the names that answered. A member that re-registers meanwhile has restarted: it is
        passed to `on_reply` with its Hello, which should count it as a failed answer."""
        waiting = set(names)
        answered: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = self.next_reply(left)
            if got is None:
                continue
            name, rcv = got
            if isinstance(rcv.message.body, Shutdown):
                waiting.discard(name)  # it left: nothing more to wait for
                continue
            if name in waiting and on_reply(name, rcv):
                waiting.discard(name)
                answered.add(name)
        return answered

    def _name_of(self, identity: bytes) -> str | None:
        for member in self.members.values():
            if member.identity == identity:
                return member.name
        return None

    def close(self) -> None:
        self.link.close()
        release(self.ctx)  # a CURVE bind's ZAP handler: term() would wait on its socket
        self.ctx.term()
