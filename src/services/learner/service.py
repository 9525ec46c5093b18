"""Learner: collects a step's groups, drops the too-stale, trains, reports the step.

It is the sink of the data plane: it acknowledges a group only once the step that used it
is done, so a learner that dies before that loses nothing; a group dropped as too stale is
acknowledged as soon as the controller has been told (it is settled then). Its reports go
through `StepReports`, which sends them again to a restarted controller until confirmed.

The order of a step is train, checkpoint (with the step's report), publish, report, ack.
A learner killed after the checkpoint resumes with weights that include the step: it
acknowledges the step's groups when they are delivered again instead of training them a
second time, and reports the step again (the controller ignores a step it already has).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pipeline.runtime.checkpoint_clock import CheckpointClock
from pipeline.runtime.gpu_sharing import takes_turns
from pipeline.runtime.ranks import TrainerThread, encode_groups
from pipeline.runtime.service import Output, Service
from pipeline.training.batch import group_stats
from pipeline.training.warm_up import Recompiles, compile_counts
from pipeline.transport import Delivery
from pipeline.transport.channel import cancel_and_wait
from pipeline.transport.security import refused as refused_peers
from pipeline.wire import codec
from pipeline.wire.messages import RankCommand, RankOp, StepDone
from pipeline.wire.samples import GroupArrays, finished_age, on_policy, read_group, staleness
from services.learner.step_reports import StepReports
from services.learner.worker import LearnerWorker, TrainedStep, early_parts


def batch_stats(groups: list[GroupArrays]) -> dict[str, float]:
    """What the step's samples look like, whoever trains on them."""
    scores = [s.score for g in groups for s in g.samples]
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    return {
        "reward_mean": float(np.mean(scores)) if scores else 0.0,
        "reward_max": float(np.max(scores)) if scores else 0.0,
        "response_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "response_len_min": float(min(lengths, default=0)),
        "response_len_max": float(max(lengths, default=0)),
        "tokens": float(sum(lengths)),
        "reward_errors": float(sum(g.reward_errors for g in groups)),
    }


class LearnerService(Service):
    role = "learner"
    # built during the handshake when the model is a local directory
    early_parts = staticmethod(early_parts)

    @classmethod
    def follower(cls, ctx: Any) -> LearnerWorker:
        """A learner rank other than 0 (torchrun): the model side of rank 0's steps."""
        return LearnerWorker(ctx)

    async def setup(self) -> None:
        self.version = self.ctx.policy_version
        self.step = self.version
        self.worker: LearnerWorker | None = None
        self.weights: Any = None  # rank 0's link to the engines (LearnerWeights)
        # the engines on this learner's GPU pause while it trains (run.gpu_sharing)
        self.turns = takes_turns(self.config)
        self.thread = TrainerThread("learner", self.ctx.ranks)
        self.reports: StepReports | None = None
        self._watch: asyncio.Task[None] | None = None
        self.recompiles = Recompiles()
        # rank 0 decides when to save and tells the other ranks (RankOp.CHECKPOINT)
        learner = self.config.learner
        self.checkpoint_clock = CheckpointClock(
            learner.checkpoint_every, learner.checkpoint_every_s
        )
        # what the weights include last: from the checkpoint resumed, then each step trained
        self.last_step: TrainedStep | None = None
        # queue uids of the groups the resumed checkpoint's weights already include
        self.settled: frozenset[str] = frozenset()
        if self.ctx.control is not None:  # not when replaying
            self.reports = StepReports(self.ctx.control)
            self._watch = asyncio.create_task(self.reports.watch())
        known = self.ctx.policy_version  # the controller's: steps reported so far
        await self._build()
        self.recompiles.mark()
        if self.last_step is not None and self.reports is not None:
            await self.settle(self.last_step)
        if self.reports is not None:
            self._settle_reported()
        if known > self.step and self.ctx.control is not None:
            # the checkpoint is older than the last reported step (checkpoint_every > 1,
            # or 0): those updates are lost, but step numbers and versions go on from the
            # controller's, so no step is reported twice and staleness stays consistent
            self.log.warning(
                "resumed_behind",
                checkpoint_step=self.step,
                reported_steps=known,
                lost_updates=known - self.step,
                hint="set learner.checkpoint_every = 1 to lose none",
            )
            self.version = self.step = known
            self._serve_as(known)

    async def _build(self) -> None:
        """Every rank builds the trainer (rank 0 decides where to resume); rank 0 links the
        weight publisher to the engines."""
        from pipeline.training import latest_step
        from pipeline.weights.link import make_hub
        from services.learner.weights import LearnerWeights

        # engines register with rank 0's hub; not when replaying
        hub = make_hub(self.ctx) if self.ctx.control is not None else None
        self.worker = LearnerWorker(self.ctx, hub=hub)
        resume = latest_step(self.worker.checkpoints)
        step = -1 if resume is None else resume
        command = RankCommand(op=RankOp.SETUP, step=step)
        loaded = await self.thread.run(self.worker.build, step, command=command)
        # the weights are this version: the checkpoint's, or the initial weights' 0
        self.version = self.step = self.worker.trainer.step
        if loaded is not None:
            if "trained_step" in loaded.extra:
                self.last_step = TrainedStep.from_json(loaded.extra["trained_step"])
            # the weights are this version, whatever the controller last heard
            self.ctx.policy_version = self.step
            self.log.info("resumed", step=self.step)
        if hub is not None:
            self.weights = LearnerWeights(self.ctx, hub, self.worker.publisher, self.thread)

    def _serve_as(self, version: int) -> None:
        """Serve the current weights as `version` (a resume behind the reported steps)."""
        self.ctx.policy_version = version
        if self.ctx.control is not None:
            self.ctx.control.policy_version = version
        if self.weights is not None:
            self.weights.version = version  # what a (re)registering engine is sent

    @property
    def _reported_path(self) -> Path:
        return Path(self.ctx.run_dir) / "learner" / "reported.jsonl"

    def _note_reported(self, step: int, group_uids: list[str]) -> None:
        """Durably note a step's groups before reporting it: a learner killed between the
        report and the acks (with no checkpoint of that step) must not train them again."""
        if self.ctx.control is None:  # replaying
            return
        path = self._reported_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": step, "groups": group_uids}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _settle_reported(self) -> None:
        """Groups of every step reported before a restart: acknowledged, never retrained."""
        assert self.ctx.input is not None
        path = self._reported_path
        if not path.exists():
            return
        uids: set[str] = set()
        for line in path.read_text().splitlines():
            try:
                uids.update(json.loads(line)["groups"])
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill: its step was not reported yet
        self.settled = self.settled | frozenset(uids)
        self.ctx.input.mark_done(uids)
        self.log.info("reported_groups_settled", groups=len(uids))

    async def settle(self, trained: TrainedStep) -> None:
        """The step the resumed weights end with may not have been reported or acknowledged
        (killed after its checkpoint): acknowledge its groups instead of training them again,
        and report it again: a StepDone identical to the first, ignored if it arrived."""
        assert self.ctx.input is not None and self.ctx.control is not None
        assert self.reports is not None
        self.settled = self.settled | frozenset(trained.group_uids)
        # deliveries from now on are acknowledged by the queue; ones already buffered, in
        # collect()
        self.ctx.input.mark_done(self.settled)
        self.ctx.control.policy_version = self.version
        await self.reports.step_done(trained.done)
        self.log.info(
            "resumed_step_settled",
            step=trained.done.step,
            policy_version=trained.done.policy_version,
            groups=len(self.settled),
        )

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
            if delivery.uid in self.settled:
                delivery.ack()  # trained in the step the resumed weights end with
                continue
            group = read_group(delivery.message)
            if finished_age(group, self.version) > bound:
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
            if self.turns and self.weights is not None:
                await self.weights.pause(self.version + 1)
            if self.worker is not None:
                pending = await self._submit(groups, self.step, self.version)
                metrics.update(await self._metrics(groups, pending))
            self.span("train", wall, time.time(), step=self.step)
            metrics["step_seconds"] = time.perf_counter() - start
            metrics["tokens_per_s"] = metrics["tokens"] / max(metrics["step_seconds"], 1e-9)
            metrics["staleness_max"] = float(max(lag, default=0))
            metrics["staleness_mean"] = float(np.mean(lag)) if lag else 0.0
            metrics["dropped_stale"] = float(sum(len(g.samples) for _, g in stale))
            # peers refused at the handshake (the weight hub's and the queues' sockets)
            metrics.update({f"learner/refused.{k}": float(v) for k, v in refused_peers().items()})
            done = StepDone(
                step=self.step,
                policy_version=self.version + 1,
                trained_uids=[s.uid for g in groups for s in g.samples],
                dropped_uids=[s.uid for _, g in stale for s in g.samples],
                metrics=dict(metrics),
            )
            if self.worker is not None:
                wall = time.time()
                await self._checkpoint(TrainedStep(done, [d.uid for d, _ in fresh]))
                self.span("checkpoint", wall, time.time(), step=self.step)
            self.step += 1
            self.version += 1
            if self.weights is not None:
                wall = time.time()
                metrics.update(await self.weights.sync(self.version))
                self.span("weight_sync", wall, time.time(), version=self.version)
            self.ctx.control.policy_version = self.version
            self._note_reported(done.step, [d.uid for d, _ in fresh])
            await self.reports.step_done(msgspec.structs.replace(done, metrics=metrics))
            await self.report(self.step - 1, metrics)
            for delivery, _ in fresh:
                delivery.ack()

    def _submit(self, groups: list[GroupArrays], step: int, version: int) -> Awaitable[Any]:
        """One PPO step queued on every rank: the caller awaits its PendingStep (no frame
        of this method between the loop and the trainer in a traceback). `version`: the
        weights' version, which tells an on-policy batch (every rank decides alike)."""
        assert self.worker is not None
        command = None  # the batch is encoded and copied only for follower ranks
        if self.thread.has_followers:
            command = RankCommand(
                op=RankOp.TRAIN, step=step, version=version, groups=encode_groups(groups)
            )
        batch = self.worker.rank_batch(groups)
        fresh = on_policy(groups, version)
        submit = functools.partial(
            self.worker.trainer.submit_step, on_policy=fresh, version=version
        )
        return self.thread.run(submit, batch, command=command)

    async def _metrics(self, groups: list[GroupArrays], pending: Any) -> dict[str, float]:
        """The step's metrics (waiting for the device), with the groups' stage stats."""
        metrics = await self.thread.run(pending.result)
        compiled = compile_counts()
        # graphs compiled since the setup's warm-up: 0 unless a step met something new
        compiled["compile/recompiles"] = self.recompiles.since()
        return {**group_stats(groups), **{k: float(v) for k, v in metrics.items()}, **compiled}

    async def _checkpoint(self, trained: TrainedStep) -> None:
        """Note the step just trained; save with it when the checkpoint clock says so
        (`checkpoint_every` steps, `checkpoint_every_s` seconds). Called before the step is
        reported or its groups acknowledged."""
        self.last_step = trained
        count = trained.done.step + 1  # updates the weights hold
        if self.checkpoint_clock.due(count):
            await self._save(RankOp.CHECKPOINT, self.worker.save)  # type: ignore[union-attr]
            self.checkpoint_clock.saved(count)

    async def _save(self, op: RankOp, save: Any) -> None:
        extra = {} if self.last_step is None else {"trained_step": self.last_step.to_json()}
        command = RankCommand(op=op, text=json.dumps(extra))
        await self.thread.run(save, extra, command=command)

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
            if self.worker is not None:
                pending = await self._submit(groups, step, step)
                metrics.update(await self._metrics(groups, pending))
                trained = [s.uid for g in groups for s in g.samples]
                done = StepDone(
                    step=step, policy_version=step + 1, trained_uids=trained, metrics=metrics
                )
                await self._checkpoint(TrainedStep(done, steps[step]))
            await self.report(step, metrics)
        return []

    async def teardown(self) -> None:
        if self._watch is not None:
            await cancel_and_wait([self._watch])
        if self.weights is not None:
            await self.weights.close()
        if self.worker is not None and self.worker.trainer is not None:
            await self._save(RankOp.CLOSE, self.worker.close)
            if self.worker.trainer.step > 0:
                self.log.info("saved", step=self.worker.trainer.step)
        self.thread.close()


# what `pipeline replay` and subclasses in other modules find here
SERVICE = LearnerService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("learner", LearnerService, argv)
