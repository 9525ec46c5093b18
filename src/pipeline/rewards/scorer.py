"""Batched reward scoring that a broken reward function cannot stop.

Built-in verifiers are trusted and fast, so they run inline. User functions run in worker
processes, because a hanging Python function cannot be interrupted in a thread: on a timeout
the worker is killed by pid and replaced, the sample scores 0, and the batch goes on. Requests
and replies are msgspec msgpack over a socket pair (see `wire`), never pickle.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from pipeline.errors import ConfigError, PipelineError
from pipeline.log import get_logger
from pipeline.rewards.registry import RewardFn, RewardNotFound, is_builtin, resolve
from pipeline.rewards.types import (
    ScoreItem,
    ScorerCounters,
    ScoreResult,
    ScoreStatus,
    coerce_score,
)
from pipeline.runtime.child_worker import ChildLost as _WorkerLost
from pipeline.runtime.child_worker import ChildTimeout as _WorkerTimeout
from pipeline.runtime.child_worker import ChildWorker, close_workers, short
from pipeline.wire.reward import DECODER, ENCODER, WorkerHello, WorkerReply, WorkerRequest

DEFAULT_KEY = "*"
_log = get_logger("rewards.scorer")


class ScorerError(PipelineError):
    """The scorer cannot work at all (a worker never starts, or it was used after close)."""


class _Worker(ChildWorker):
    """A reward worker process with `preload` specs loaded at its start."""

    def __init__(self, preload: Sequence[str], startup_timeout_s: float) -> None:
        args = [arg for spec in preload for arg in ("--preload", spec)]
        super().__init__("pipeline.rewards.worker", args, DECODER, WorkerHello, startup_timeout_s)
        self._seq = itertools.count()

    def call(self, item: ScoreItem, spec: str, timeout_s: float) -> WorkerReply:
        request = WorkerRequest(
            seq=next(self._seq),
            spec=spec,
            data_source=item.data_source,
            solution_str=item.solution_str,
            ground_truth=item.ground_truth,
            extra_info=item.extra_info,
        )
        payload = ENCODER.encode(request)  # un-encodable extra_info raises before sending
        reply = self.ask(payload, timeout_s)
        if not isinstance(reply, WorkerReply) or reply.seq != request.seq:
            raise _WorkerLost("worker replied out of order")
        return reply


class RewardScorer:
    """Scores batches with per-sample time limits; failures score 0 and are counted.

    `rewards` is one reward spec for every sample, or a map from `data_source` to spec with an
    optional `"*"` fallback; a spec is a built-in name (`registry.BUILTIN_REWARDS`) or a user
    function `module:function` / `path/to/file.py:function`. Built-ins run inline and are not
    time-limited (the math built-in bounds its symbolic check itself, in a worker of its own);
    user functions run in `num_workers` worker processes with `timeout_s` each.
    """

    def __init__(
        self,
        rewards: str | Mapping[str, str] = "auto",
        *,
        timeout_s: float = 5.0,
        num_workers: int = 1,
        startup_timeout_s: float = 30.0,
    ) -> None:
        if timeout_s <= 0 or num_workers < 1 or startup_timeout_s <= 0:
            raise ConfigError(
                "reward scorer needs timeout_s > 0, num_workers >= 1 and startup_timeout_s > 0; "
                f"got {timeout_s}, {num_workers}, {startup_timeout_s}"
            )
        self._table = {DEFAULT_KEY: rewards} if isinstance(rewards, str) else dict(rewards)
        self._table.setdefault(DEFAULT_KEY, "auto")
        self.timeout_s = timeout_s
        self._inline: dict[str, RewardFn] = {
            spec: resolve(spec) for spec in set(self._table.values()) if is_builtin(spec)
        }
        user_specs = sorted({s for s in self._table.values() if not is_builtin(s)})
        self._counters = ScorerCounters()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer = weakref.finalize(self, close_workers, self._workers)
        if user_specs:
            self._start_workers(user_specs, num_workers, startup_timeout_s)

    def _start_workers(self, specs: list[str], count: int, startup_timeout_s: float) -> None:
        """Start workers and load user code now, so a bad spec fails at startup, not mid-run."""
        try:
            for _ in range(count):
                worker = _Worker(specs, startup_timeout_s)
                self._workers.append(worker)
                self._idle.put(worker)
            errors = self._workers[0].hello().load_errors
        except (_WorkerLost, OSError) as exc:
            self.close()
            raise ScorerError(f"reward worker could not start: {exc}") from exc
        if errors:
            self.close()
            raise RewardNotFound("; ".join(errors[s] for s in sorted(errors)))
        if count > 1:
            self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="reward")
        _log.info("reward workers started", specs=specs, pids=self.worker_pids)

    @property
    def counters(self) -> ScorerCounters:
        """A snapshot of the running totals."""
        with self._lock:
            return msgspec.structs.replace(self._counters)

    @property
    def worker_pids(self) -> list[int]:
        """Current worker pids (they change when a worker is replaced)."""
        return [w.pid for w in self._workers if w.pid is not None]

    def spec_for(self, data_source: str) -> str:
        """The reward spec that scores samples of `data_source`."""
        return self._table.get(data_source, self._table[DEFAULT_KEY])

    def score_batch_sync(self, items: Iterable[ScoreItem]) -> list[ScoreResult]:
        """Score every item; never raises because of a reward function."""
        if self._closed:
            raise ScorerError("reward scorer used after close()")
        batch = list(items)
        results: list[ScoreResult | None] = [None] * len(batch)
        remote: list[int] = []
        for i, item in enumerate(batch):
            spec = self.spec_for(item.data_source)
            if spec in self._inline:
                results[i] = self._score_inline(item, self._inline[spec])
            else:
                remote.append(i)
        if self._pool is not None and len(remote) > 1:
            futures = [
                self._pool.submit(self._score_remote, batch[i], self.spec_for(batch[i].data_source))
                for i in remote
            ]
            for i, future in zip(remote, futures, strict=True):
                results[i] = future.result()
        else:
            for i in remote:
                results[i] = self._score_remote(batch[i], self.spec_for(batch[i].data_source))
        return [r for r in results if r is not None]

    async def score_batch(self, items: Iterable[ScoreItem]) -> list[ScoreResult]:
        """`score_batch_sync` off the event loop, so a slow batch never blocks the service."""
        return await asyncio.to_thread(self.score_batch_sync, list(items))

    def _score_inline(self, item: ScoreItem, fn: RewardFn) -> ScoreResult:
        start = time.monotonic()
        try:
            value = coerce_score(
                fn(item.data_source, item.solution_str, item.ground_truth, item.extra_info)
            )
        except Exception as exc:
            return self._failed(item, "error", f"{type(exc).__name__}: {exc}", start)
        return self._ok(item, value, start)

    def _score_remote(self, item: ScoreItem, spec: str) -> ScoreResult:
        start = time.monotonic()
        worker = self._idle.get()
        try:
            try:
                reply = worker.call(item, spec, self.timeout_s)
            except _WorkerTimeout:
                old_pid = worker.pid
                self._replace(worker)
                _log.warning(
                    "reward timed out; worker replaced",
                    uid=item.uid,
                    spec=spec,
                    timeout_s=self.timeout_s,
                    old_pid=old_pid,
                    new_pid=worker.pid,
                )
                return self._failed(item, "timeout", f"no result within {self.timeout_s}s", start)
            except _WorkerLost as exc:
                self._replace(worker)
                return self._failed(item, "error", str(exc), start)
            except (msgspec.EncodeError, TypeError, OverflowError) as exc:
                return self._failed(
                    item, "error", f"item cannot be sent to the worker: {exc}", start
                )
        finally:
            self._idle.put(worker)
        if reply.error is not None:
            return self._failed(item, "error", reply.error, start)
        return self._ok(item, reply.score, start)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        if self._closed:
            return
        try:
            worker.start()
        except OSError as exc:  # retried on the worker's next call
            _log.error("reward worker restart failed", error=str(exc))
            return
        with self._lock:
            self._counters.worker_restarts += 1

    def _ok(self, item: ScoreItem, score: float, start: float) -> ScoreResult:
        with self._lock:
            self._counters.ok += 1
        return ScoreResult(item.uid, score, "ok", None, time.monotonic() - start)

    def _failed(
        self, item: ScoreItem, status: ScoreStatus, error: str, start: float
    ) -> ScoreResult:
        with self._lock:
            if status == "timeout":
                self._counters.timeouts += 1
            else:
                self._counters.errors += 1
        if status == "error":
            _log.warning("reward failed", uid=item.uid, data_source=item.data_source, error=error)
        return ScoreResult(item.uid, 0.0, status, short(error), time.monotonic() - start)

    def close(self) -> None:
        """Stop every worker (EOF, then SIGKILL by pid); safe to call more than once."""
        self._closed = True
        self._finalizer()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
