"""The rollout service's environment workers: episodes' calls with a deadline each.

Each episode lives in one worker (its instance keeps state there). A worker takes one call
at a time, or the calls of all its episodes together when the environment's `step` is a
coroutine (one that waits on a tool must not hold up the other episodes); a reader thread
per worker hands each reply to its call by `seq`. A call that raises, returns garbage or
outlives `step_timeout_s` fails that episode only: a hung worker is killed by pid and
started again, its calls in flight fail as lost, and the other episodes it hosted fail as
lost on their next call. Every failure is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.envs.types import EnvironmentNotFound, Episode, StepResult, field_means
from pipeline.errors import PipelineError
from pipeline.log import get_logger
from pipeline.runtime.child_worker import ChildLost, ChildWorker, close_workers
from pipeline.wire.env import DECODER, ENCODER, EnvClose, EnvHello, EnvOpen, EnvReply, EnvStep

FailureKind = Literal["error", "timeout", "lost"]


class EnvFailure(PipelineError):
    """One call of one episode failed; the episode ends, the run goes on."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(f"environment {kind}: {message}")
        self.kind = kind


@dataclass
class EnvCounters:
    episodes: int = 0
    steps: int = 0
    errors: int = 0
    timeouts: int = 0
    lost: int = 0
    restarts: int = 0

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return field_means([self], prefix)


class EnvPool:
    def __init__(
        self,
        spec: str,
        *,
        options: Mapping[str, Any] | None = None,
        workers: int = 1,
        step_timeout_s: float = 10.0,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.counters = EnvCounters()
        self.log = get_logger("envs.pool")
        args = ["--spec", spec, "--options", json.dumps(dict(options or {}))]
        self._workers: list[ChildWorker] = []
        try:
            for _ in range(max(1, workers)):
                self._workers.append(
                    ChildWorker("pipeline.envs.worker", args, DECODER, EnvHello, startup_timeout_s)
                )
            hello: EnvHello = self._workers[0].hello()
        except (ChildLost, OSError) as exc:
            self.close()
            raise PipelineError(f"environment worker could not start: {exc}") from exc
        if hello.load_error:
            self.close()
            raise EnvironmentNotFound(hello.load_error)
        self.stop = tuple(hello.stop)
        self.concurrent = hello.concurrent
        # a plain environment's call holds its worker until answered: the calls queue here,
        # not in the worker, so each one's deadline starts when the worker takes it
        self._turns = [asyncio.Lock() for _ in self._workers]
        self._locks = [asyncio.Lock() for _ in self._workers]  # a send, or a restart
        self._pending: list[dict[int, asyncio.Future[Any]]] = [{} for _ in self._workers]
        self._readers: list[threading.Thread | None] = [None] * len(self._workers)
        self._generation = [0] * len(self._workers)
        self._home: dict[str, tuple[int, int]] = {}  # episode uid -> (worker, generation)
        self._seq = itertools.count()

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    async def open(self, episode: Episode) -> str:
        """Make the episode's instance and reset it: the observation after the prompt."""
        loads = [0] * len(self._workers)
        for index, _ in self._home.values():
            loads[index] += 1
        index = loads.index(min(loads))
        self._home[episode.uid] = (index, self._generation[index])
        self.counters.episodes += 1
        reply = await self._call(episode.uid, EnvOpen(seq=next(self._seq), episode=episode))
        return reply.observation

    async def step(self, uid: str, action: str) -> StepResult:
        self.counters.steps += 1
        reply = await self._call(uid, EnvStep(seq=next(self._seq), uid=uid, action=action))
        return StepResult(
            observation=reply.observation,
            reward=reply.reward,
            done=reply.done,
            tool_call=reply.tool_call,
            tool_error=reply.tool_error,
        )

    async def close_episode(self, uid: str, cancelled: bool) -> None:
        """Tell the episode's instance it is over; a failure here is counted, not raised."""
        try:
            await self._call(uid, EnvClose(seq=next(self._seq), uid=uid, cancelled=cancelled))
        except EnvFailure:
            pass
        finally:
            self._home.pop(uid, None)

    async def _call(self, uid: str, request: EnvOpen | EnvStep | EnvClose) -> EnvReply:
        home = self._home.get(uid)
        if home is None:
            raise EnvFailure("lost", f"episode {uid} has no environment (never opened)")
        index, generation = home
        async with contextlib.nullcontext() if self.concurrent else self._turns[index]:
            reply = await self._ask(uid, index, generation, request)
        if reply.error is not None:
            self.counters.errors += 1
            raise EnvFailure("error", reply.error)
        return reply

    async def _ask(
        self, uid: str, index: int, generation: int, request: EnvOpen | EnvStep | EnvClose
    ) -> EnvReply:
        """Send `request` to worker `index` and wait for its reply, at most step_timeout_s."""
        loop = asyncio.get_running_loop()
        async with self._locks[index]:
            if isinstance(request, EnvOpen):
                # an open queued behind a call that restarted the worker: the episode was
                # not hosted there yet, so it opens in the new worker instead of failing
                generation = self._generation[index]
                self._home[uid] = (index, generation)
            if self._generation[index] != generation:
                # not for a close: the episode's data is complete, or the call that failed it
                # (the timeout that restarted the worker, its own lost call) was counted
                if not isinstance(request, EnvClose):
                    self.counters.lost += 1
                raise EnvFailure("lost", "its environment worker was restarted")
            answer: asyncio.Future[Any] = loop.create_future()
            self._pending[index][request.seq] = answer
            try:
                await self._connect(index, loop)
                await asyncio.to_thread(self._workers[index].send, ENCODER.encode(request))
            except ChildLost as exc:
                self._pending[index].pop(request.seq, None)
                self.counters.lost += 1
                await self._restart(index, str(exc))
                raise EnvFailure("lost", str(exc)) from exc
        try:
            return await asyncio.wait_for(answer, self.step_timeout_s)
        except TimeoutError:
            self.counters.timeouts += 1
            await self._restart_if(index, generation, "timeout")
            raise EnvFailure("timeout", f"no answer within {self.step_timeout_s}s") from None
        except ChildLost as exc:
            self.counters.lost += 1
            await self._restart_if(index, generation, str(exc))
            raise EnvFailure("lost", str(exc)) from exc
        finally:
            self._pending[index].pop(request.seq, None)

    async def _connect(self, index: int, loop: asyncio.AbstractEventLoop) -> None:
        """Under the worker's lock: the worker started and past its hello, and a thread that
        reads its replies (ChildLost if it cannot start)."""
        if self._readers[index] is not None:
            return
        worker = self._workers[index]
        await asyncio.to_thread(worker.ready)
        reader = threading.Thread(
            target=self._read,
            args=(loop, index, self._generation[index], worker.receiver()),
            name=f"env-replies-{index}",
            daemon=True,
        )
        reader.start()
        self._readers[index] = reader

    def _read(
        self, loop: asyncio.AbstractEventLoop, index: int, generation: int, receive: Any
    ) -> None:
        """In a thread: the worker's replies to their calls, until its stream ends."""

        def post(*args: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._deliver, index, generation, *args)

        while True:
            try:
                reply = receive(None)
            except ChildLost as exc:
                post(None, exc)
                return
            if not isinstance(reply, EnvReply):
                post(None, ChildLost(f"the worker sent {type(reply).__name__}, not a reply"))
                return
            post(reply, None)

    def _deliver(
        self, index: int, generation: int, reply: EnvReply | None, failure: ChildLost | None
    ) -> None:
        """On the loop: a reply to its call, or a broken stream to every call in flight."""
        if self._generation[index] != generation:  # from a worker killed since
            return
        pending = self._pending[index]
        if reply is not None:
            answer = pending.get(reply.seq)
            if answer is not None and not answer.done():
                answer.set_result(reply)
            return
        self._readers[index] = None
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(failure or ChildLost("the worker's stream ended"))

    async def _restart_if(self, index: int, generation: int, why: str) -> None:
        """Restart worker `index` unless a call beside this one already did."""
        async with self._locks[index]:
            if self._generation[index] == generation:
                await self._restart(index, why)

    async def _restart(self, index: int, why: str) -> None:
        """Under the worker's lock: kill it by pid and start it again; its calls in flight
        fail as lost."""
        worker = self._workers[index]
        old = worker.pid
        self._generation[index] += 1
        self._readers[index] = None
        pending, self._pending[index] = self._pending[index], {}
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(ChildLost("its environment worker was restarted"))
        await asyncio.to_thread(worker.kill)
        try:
            await asyncio.to_thread(worker.start)
        except OSError as exc:  # retried on the worker's next call
            self.log.error("env_worker_restart_failed", error=str(exc))
            return
        self.counters.restarts += 1
        self.log.warning("env_worker_restarted", why=why, old_pid=old, new_pid=worker.pid)

    def close(self) -> None:
        """Stop every worker (EOF, then SIGKILL by pid); safe to call more than once."""
        close_workers(self._workers)
