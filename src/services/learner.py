"""Learner: collects a step's groups, drops the too-stale, trains, reports the step.

It is the sink of the data plane: it acknowledges a group only once the step that used it
is done, so a learner that dies before that loses nothing; a group dropped as too stale is
acknowledged as soon as the controller has been told (it is settled then). Its reports go
through `StepReports`, which sends them again to a restarted controller until confirmed.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import codec
from pipeline.messages import StepDone
from pipeline.runtime.service import Output, Service
from pipeline.samples import GroupArrays, read_group
from pipeline.step_reports import StepReports
from pipeline.transport import Delivery
from pipeline.transport.channel import cancel_and_wait


def staleness(group: GroupArrays, version: int) -> int:
    """How many versions behind the learner the oldest token of the group is."""
    oldest = min(
        (int(s.token_versions.min()) for s in group.samples if len(s.token_versions)),
        default=version,
    )
    return version - oldest


def batch_stats(groups: list[GroupArrays]) -> dict[str, float]:
    """What the step's samples look like, whoever trains on them."""
    scores = [s.score for g in groups for s in g.samples]
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    return {
        "reward_mean": float(np.mean(scores)) if scores else 0.0,
        "reward_max": float(np.max(scores)) if scores else 0.0,
        "response_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "tokens": float(sum(lengths)),
        "reward_errors": float(sum(g.reward_errors for g in groups)),
    }


class LearnerService(Service):
    role = "learner"

    async def setup(self) -> None:
        self.version = self.ctx.policy_version
        self.step = self.version
        self.trainer: Any = None
        self.reports: StepReports | None = None
        self._watch: asyncio.Task[None] | None = None
        if self.ctx.control is not None:  # not when replaying
            self.reports = StepReports(self.ctx.control)
            self._watch = asyncio.create_task(self.reports.watch())
        if not self.config.run.standin:
            from pipeline.learner_worker import LearnerWorker

            self.trainer = LearnerWorker(self.ctx)
            await self.trainer.setup()
            self.version = self.step = self.trainer.step

    async def collect(
        self,
    ) -> tuple[list[tuple[Delivery, GroupArrays]], list[tuple[Delivery, GroupArrays]]]:
        assert self.ctx.input is not None and self.reports is not None
        need = self.config.controller.prompts_per_step
        bound = self.config.controller.max_staleness
        fresh: list[tuple[Delivery, GroupArrays]] = []
        stale: list[tuple[Delivery, GroupArrays]] = []
        while len(fresh) < need and not self.ctx.stop.is_set():
            try:
                delivery = await self.ctx.input.get(timeout=0.2)
            except TimeoutError:
                continue
            group = read_group(delivery.message)
            if staleness(group, self.version) > bound:
                stale.append((delivery, group))
                # tell the controller now, so it releases replacements for this step, and
                # acknowledge now: the controller has counted it as dropped, and holding it
                # would keep its prompt in flight (a stall once max_inflight_prompts of
                # stale groups pile up, e.g. behind an engine that restarted)
                await self.reports.dropped([s.uid for s in group.samples], self.version)
                delivery.ack()
            else:
                fresh.append((delivery, group))
        return fresh, stale

    async def run(self) -> None:
        assert self.ctx.control is not None and self.reports is not None
        while not self.ctx.stop.is_set():
            if self._watch is not None and self._watch.done():
                self._watch.result()  # a failed watcher fails the service visibly
            fresh, stale = await self.collect()
            if self.ctx.stop.is_set():
                return
            groups = [g for _, g in fresh]
            lag = [staleness(g, self.version) for g in groups]
            start = time.perf_counter()
            metrics = batch_stats(groups)
            wall = time.time()
            if self.trainer is not None:
                metrics.update(await self.trainer.train(groups, self.step))
            self.span("train", wall, time.time(), step=self.step)
            metrics["step_seconds"] = time.perf_counter() - start
            metrics["tokens_per_s"] = metrics["tokens"] / max(metrics["step_seconds"], 1e-9)
            metrics["staleness_max"] = float(max(lag, default=0))
            metrics["staleness_mean"] = float(np.mean(lag)) if lag else 0.0
            self.step += 1
            self.version += 1
            if self.trainer is not None:
                wall = time.time()
                metrics.update(await self.trainer.publish(self.version))
                self.span("weight_sync", wall, time.time(), version=self.version)
            self.ctx.control.policy_version = self.version
            await self.reports.step_done(
                StepDone(
                    step=self.step - 1,
                    policy_version=self.version,
                    trained_uids=[s.uid for g in groups for s in g.samples],
                    dropped_uids=[s.uid for _, g in stale for s in g.samples],
                    metrics=metrics,
                )
            )
            await self.report(self.step - 1, metrics)
            for delivery, _ in fresh:
                delivery.ack()

    async def replay(self, messages: list[codec.Message], run_dir: Path) -> list[Output]:
        """Re-run the recorded run's learner exactly: the same groups at the same steps.

        The controller's schedule (`schedule.jsonl`: which uid was trained at which step)
        says how the asynchronous run batched what arrived; stale groups it dropped are
        not in it, so they are skipped here too.
        """
        by_uid = {m.body.uid: m for m in messages}
        steps: dict[int, list[str]] = {}
        for line in (run_dir / "schedule.jsonl").read_text().splitlines():
            record = json.loads(line)
            prompt_uid = record["uid"].rsplit("/", 1)[0]
            members = steps.setdefault(record["step"], [])
            if prompt_uid not in members:
                members.append(prompt_uid)
        for step in sorted(steps):
            groups = [read_group(by_uid[uid]) for uid in steps[step]]
            metrics = batch_stats(groups)
            if self.trainer is not None:
                metrics.update(await self.trainer.train(groups, step))
            await self.report(step, metrics)
        return []

    async def teardown(self) -> None:
        if self._watch is not None:
            await cancel_and_wait([self._watch])
        if self.trainer is not None:
            await self.trainer.close()


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("learner", LearnerService, argv)


if __name__ == "__main__":
    raise SystemExit(main())
