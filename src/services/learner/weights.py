"""Rank 0's link to the rollout engines' weights: a sync after each step, a re-sync of an
engine that (re)registers, a retry on a timer after a failed sync. The hub, publisher and
receivers it drives are the library's (`pipeline.weights`, wired by `pipeline.weights.link`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipeline.log import get_logger

log = get_logger("weight_link")

# seconds after a failed weight sync before the current version is published again,
# doubling with each failure in a row up to RETRY_MAX_S
RETRY_S = 2.0
RETRY_MAX_S = 30.0


class LearnerWeights:
    """Rank 0's side of the engines: sync after each step, re-sync a (re)registered engine
    between steps, publish again on a timer after a failed sync; reports seconds and GB/s.
    The publish itself runs on the trainer's thread, with a sharded learner's other ranks
    told first."""

    def __init__(self, ctx: Any, hub: Any, publisher: Any, thread: Any) -> None:
        self.hub = hub
        self.publisher = publisher
        self.thread = thread
        # one receiver per engine rank (a TP replica registers each of its ranks)
        self.replicas = ctx.config.replicas("rollout") * ctx.config.ranks_per_replica("rollout")
        self.version = ctx.policy_version  # the version the engines should serve
        self._lock = asyncio.Lock()  # one user of the hub's socket at a time
        self._failures = 0  # failed syncs in a row (each retry and step sync counts)
        self._retries = 0  # retries since the last sync that went through
        self._retry_at: float | None = None  # monotonic time of the next retry
        self._closing = False
        self._watch = asyncio.get_running_loop().create_task(self._watch_members())

    async def _watch_members(self, every_s: float = 1.0) -> None:
        """An engine that (re)registers between steps gets the current weights now, not at
        the next step: a restarted engine would otherwise generate with its initial weights
        and every sample would be dropped as stale, so no step would ever come. For the
        same reason a failed sync is published again here: an engine that stays registered
        but missed more than max_staleness versions would otherwise never be re-synced."""
        while True:
            await asyncio.sleep(every_s)
            async with self._lock:
                if self._closing:
                    return
                await asyncio.to_thread(self.hub.poll, 0.0)
                joined = self.hub.changed and bool(self.hub.members)
                due = self._retry_at is not None and time.monotonic() >= self._retry_at
                if joined:
                    log.info("engines_changed", engines=self.hub.names(), version=self.version)
                elif due:
                    self._retries += 1
                    log.warning(
                        "weight_sync_retry",
                        version=self.version,
                        attempt=self._retries,
                        failed_in_a_row=self._failures,
                    )
                if joined or due:
                    # under the lock: the version a step's sync may have moved on meanwhile
                    await self._publish(self.version)

    async def sync(self, version: int) -> dict[str, float]:
        """Publish the trainer's weights as `version`; a failed sync leaves the engines on
        the old version and the run goes on (the member watch publishes again)."""
        async with self._lock:
            return await self._publish(version)

    async def _publish(self, version: int) -> dict[str, float]:
        """`sync` with the lock held."""
        from pipeline.errors import WeightSyncError
        from pipeline.wire.messages import RankCommand, RankOp

        self.version = version
        command = RankCommand(op=RankOp.PUBLISH, version=version)
        try:
            # the publisher makes every rank raise WeightSyncError alike
            report = await self.thread.run(
                self.publisher.publish, version, command=command, agreed=(WeightSyncError,)
            )
        except WeightSyncError as exc:
            self._failures += 1
            # 2 s, doubling to 30 s: quick after a blip, without hammering a sick engine
            delay = min(RETRY_MAX_S, RETRY_S * 2 ** min(self._failures - 1, 16))
            self._retry_at = time.monotonic() + delay
            log.error("weight_sync_failed", version=version, error=str(exc), retry_in_s=delay)
            return {"sync_failed": 1.0, "weights/rejected": float(self.hub.link.rejected)}
        self._failures, self._retries, self._retry_at = 0, 0, None
        return {
            # messages the weight hub refused so far
            "weights/rejected": float(self.hub.link.rejected),
            "sync_seconds": float(report.seconds),
            "sync_gbps": float(report.gbps),
            "sync_bytes": float(report.bytes),
        }

    async def pause(self, version: int) -> None:
        """Tell every engine to stop decoding until `version` (turns on a shared device:
        the step about to train makes it)."""
        from pipeline.wire.weights import Pause

        def send_all() -> None:
            for name in self.hub.names():
                self.hub.send(name, Pause(version=version))

        async with self._lock:
            await asyncio.to_thread(send_all)

    async def close(self) -> None:
        self._closing = True
        async with self._lock:
            # a publish in flight (a step's, a re-sync's or a retry's) finishes first; a
            # cancel would release the lock while the trainer thread still publishes
            self._watch.cancel()
        self.publisher.close()
        self.hub.close()
