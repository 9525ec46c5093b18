"""Critic: values, KL-shaped rewards and advantages for each scored group, then trains.

The model side (`CriticWorker`) runs on one trainer thread; a sharded critic's rank 0
sends its other ranks each call's command first (`TrainerThread`), so every rank runs the
same methods in the same order. A restarted critic resumes from its latest checkpoint
(saved on the learner's clock, `learner.checkpoint_every` / `checkpoint_every_s`): value
model, optimizer, schedule and KL coefficient.

Groups that arrive while the trainer thread is busy wait, and go into its next forward
together (`critic.annotate_max_groups` at most, never across a value update). Which groups
shared a forward is written to `critic/batches.jsonl`, so a replay batches them alike.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pipeline.errors import RecordingError
from pipeline.runtime.json_lines import DamagedLine, JsonLines, read_json_lines
from pipeline.runtime.ranks import TrainerThread, encode_groups
from pipeline.runtime.service import Output, Service
from pipeline.transport.channel import cancel_and_wait
from pipeline.wire import codec
from pipeline.wire.messages import Experience, RankCommand, RankOp
from pipeline.wire.samples import GroupArrays, read_group, write_group

BATCHES = "batches.jsonl"  # under <run>/critic/: the groups of each forward, by uid


class CriticService(Service):
    role = "critic"
    concurrency = 4

    @staticmethod
    def early_parts(config: Any) -> Any:
        """Built during the handshake when the model is a local directory."""
        from services.critic.worker import early_parts

        return early_parts(config)

    @classmethod
    def follower(cls, ctx: Any) -> Any:
        """A critic rank other than 0 (torchrun): the value model's side of rank 0's work."""
        from services.critic.worker import CriticWorker

        return CriticWorker(ctx)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        # value updates still running after their step's last group went on
        self._updates: set[asyncio.Future[tuple[float, float] | None]] = set()
        self.max_groups = ctx.config.critic.annotate_max_groups
        self.per_step = ctx.config.controller.prompts_per_step
        # room for a full batch to gather while the one before it is annotated
        self.concurrency = max(type(self).concurrency, 2 * self.max_groups)
        self._waiting: list[tuple[GroupArrays, asyncio.Future[None]]] = []
        self._annotator: asyncio.Task[None] | None = None
        self._since_update = 0  # groups annotated since the last value update
        self._batches: JsonLines | None = None

    async def setup(self) -> None:
        from pipeline.training import latest_step
        from services.critic.worker import CriticWorker

        self.thread = TrainerThread("critic", self.ctx.ranks)
        self.worker = CriticWorker(self.ctx)
        resume = latest_step(self.worker.checkpoints)
        step = -1 if resume is None else resume
        await self.thread.run(
            self.worker.build, step, command=RankCommand(op=RankOp.SETUP, step=step)
        )

    async def teardown(self) -> None:
        if not hasattr(self, "worker"):
            return  # setup did not get that far
        try:
            if self._annotator is not None:  # groups not yet in a forward stay unacknowledged
                await cancel_and_wait([self._annotator])
            await self._finish_updates()
            if self.worker.trainer is not None:
                await self.thread.run(self.worker.save_last, command=RankCommand(op=RankOp.CLOSE))
        finally:
            self.thread.close()
            if self._batches is not None:
                self._batches.close()

    async def handle(self, message: codec.Message) -> list[Output]:
        """The group goes on as soon as its forward is done. A value update that follows
        it keeps the trainer thread (the next groups are annotated after it, as in one
        call) but not the group: the learner trains beside the critic."""
        self._raise_update_error()
        group = read_group(message)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((group, done))
        if self._annotator is None or self._annotator.done():
            self._annotator = asyncio.ensure_future(self._annotate_waiting())
        await done  # the forward's error fails its groups
        return [write_group(group, Experience)]

    async def _annotate_waiting(self) -> None:
        """The waiting groups, a forward at a time, in arrival order."""
        while self._waiting:
            room = min(self.max_groups, self.per_step - self._since_update)
            taken, self._waiting = self._waiting[:room], self._waiting[room:]
            groups = [group for group, _ in taken]
            try:
                await self._annotate(groups)
            except asyncio.CancelledError:  # the service stops: nothing more is annotated
                for _, done in taken + self._waiting:
                    done.cancel()
                raise
            except Exception as exc:
                for _, done in taken:
                    if not done.done():
                        done.set_exception(exc)
            else:
                for _, done in taken:
                    if not done.done():
                        done.set_result(None)

    async def _annotate(self, groups: list[GroupArrays]) -> None:
        """One forward on the trainer thread; returns once the groups are complete (the
        value update after them, if they end a step, goes on without them)."""
        self._since_update = (self._since_update + len(groups)) % self.per_step
        if self.max_groups > 1:
            self._record([group.uid for group in groups])
        command = None  # the groups are encoded and copied only for follower ranks
        if self.thread.has_followers:
            command = RankCommand(op=RankOp.ANNOTATE, groups=encode_groups(groups))
        loop = asyncio.get_running_loop()
        annotated: asyncio.Future[None] = loop.create_future()

        def on_annotated() -> None:
            loop.call_soon_threadsafe(_settle, annotated)

        call = asyncio.ensure_future(
            self.thread.run(self.worker.annotate, groups, on_annotated, command=command)
        )
        self._updates.add(call)
        await asyncio.wait((annotated, call), return_when=asyncio.FIRST_COMPLETED)
        call.add_done_callback(self._call_done)
        if call.done():
            call.result()  # its error fails these groups

    def _record(self, uids: list[str]) -> None:
        """Which groups share a forward, for a replay to batch them alike (not fsynced:
        a machine that dies loses only the exactness of a replay)."""
        if self._batches is None:
            path = Path(self.ctx.run_dir) / "critic" / BATCHES
            self._batches = JsonLines(path, durable=False)  # cuts a killed writer's half line
        self._batches.append({"uids": uids})

    def _call_done(self, call: asyncio.Future[tuple[float, float] | None]) -> None:
        """A finished call's value update into the run's timeline; an update that failed
        after its group went on is kept for the next group (or the teardown) to raise."""
        if call.cancelled() or call.exception() is None:
            self._updates.discard(call)
            if not call.cancelled() and (span := call.result()) is not None:
                self.span("critic_update", *span)

    def _raise_update_error(self) -> None:
        for call in [c for c in self._updates if c.done()]:
            call.result()

    async def replay(self, messages: list[codec.Message], run_dir: Path) -> list[Output]:
        """The recorded groups in the forwards the run made (`critic/batches.jsonl`; one
        group a forward where it has none), in its order; groups it does not list after."""
        pending: dict[str, GroupArrays] = {}
        for message in messages:
            group = read_group(message)
            pending.setdefault(group.uid, group)  # a redelivery is the same group
        batches = _recorded_batches(run_dir / "critic" / BATCHES)
        listed = {uid for uids in batches for uid in uids}
        batches += [[uid] for uid in pending if uid not in listed]
        outputs: list[Output] = []
        for uids in batches:
            groups = [pending.pop(uid) for uid in uids if uid in pending]
            if groups:
                await self._annotate(groups)
                outputs += [write_group(group, Experience) for group in groups]
        await self._finish_updates()
        return outputs

    async def _finish_updates(self) -> None:
        for call in list(self._updates):
            await call
        self._raise_update_error()


def _recorded_batches(path: Path) -> list[list[str]]:
    """The uids of each forward a run recorded (none without the file). A last line cut
    short (the critic killed while writing it) is left out; a damaged line before it is
    refused with its number."""
    try:
        records = read_json_lines(path)
    except DamagedLine as exc:
        raise RecordingError(f"{path}: line {exc.number} is not a batch: {exc.error}") from exc
    batches = []
    for number, record in enumerate(records, 1):
        try:
            batches.append([str(uid) for uid in record["uids"]])
        except (KeyError, TypeError) as exc:
            raise RecordingError(f"{path}: line {number} is not a batch: {exc!r}") from exc
    return batches


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# what `pipeline replay` and subclasses in other modules find here
SERVICE = CriticService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("critic", CriticService, argv)
