"""Critic: values, KL-shaped rewards and advantages for each scored group, then trains.

The model side (`CriticWorker`) runs on one trainer thread; a sharded critic's rank 0
sends its other ranks each call's command first (`TrainerThread`), so every rank runs the
same methods in the same order. A restarted critic resumes from its latest checkpoint
(`critic.checkpoint_every`): value model, optimizer, schedule and KL coefficient.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pipeline import codec
from pipeline.messages import Experience, RankCommand, RankOp
from pipeline.runtime.ranks import TrainerThread, encode_groups
from pipeline.runtime.service import Output, Service
from pipeline.samples import read_group, write_group


class CriticService(Service):
    role = "critic"
    concurrency = 4

    @staticmethod
    def early_parts(config: Any) -> Any:
        """Built during the handshake when the model is a local directory."""
        from pipeline.critic_worker import early_parts

        return early_parts(config)

    @classmethod
    def follower(cls, ctx: Any) -> Any:
        """A critic rank other than 0 (torchrun): the value model's side of rank 0's work."""
        from pipeline.critic_worker import CriticWorker

        return CriticWorker(ctx)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        # value updates still running after their step's last group went on
        self._updates: set[asyncio.Future[tuple[float, float] | None]] = set()

    async def setup(self) -> None:
        from pipeline.critic_worker import CriticWorker
        from pipeline.training import latest_step

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
            await self._finish_updates()
            if self.worker.trainer is not None:
                await self.thread.run(self.worker.save_last, command=RankCommand(op=RankOp.CLOSE))
        finally:
            self.thread.close()

    async def handle(self, message: codec.Message) -> list[Output]:
        """The group goes on as soon as it is annotated. A value update that follows it
        keeps the trainer thread (the next group is annotated after it, as in one call)
        but not the group: the learner trains beside the critic."""
        self._raise_update_error()
        group = read_group(message)
        command = RankCommand(op=RankOp.ANNOTATE, groups=encode_groups([group]))
        loop = asyncio.get_running_loop()
        annotated: asyncio.Future[None] = loop.create_future()

        def on_annotated() -> None:
            loop.call_soon_threadsafe(_settle, annotated)

        call = asyncio.ensure_future(
            self.thread.run(self.worker.annotate, group, on_annotated, command=command)
        )
        self._updates.add(call)
        await asyncio.wait([annotated, call], return_when=asyncio.FIRST_COMPLETED)
        call.add_done_callback(self._call_done)
        if call.done():
            call.result()  # its error fails this group
        return [write_group(group, Experience)]

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
        outputs = await super().replay(messages, run_dir)
        await self._finish_updates()
        return outputs

    async def _finish_updates(self) -> None:
        for call in list(self._updates):
            await call
        self._raise_update_error()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# what `pipeline replay` and subclasses in other modules find here
SERVICE = CriticService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("critic", CriticService, argv)


if __name__ == "__main__":
    raise SystemExit(main())
