"""Critic: values, KL-shaped rewards and advantages for each scored group, then trains.

The model side (`CriticWorker`) runs on one trainer thread; a sharded critic's rank 0
sends its other ranks each call's command first (`TrainerThread`), so every rank runs the
same methods in the same order. A restarted critic resumes from its latest checkpoint
(`critic.checkpoint_every`): value model, optimizer, schedule and KL coefficient.
"""

from __future__ import annotations

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
        if self.worker.trainer is not None:
            await self.thread.run(self.worker.save_last, command=RankCommand(op=RankOp.CLOSE))
        self.thread.close()

    async def handle(self, message: codec.Message) -> list[Output]:
        group = read_group(message)
        command = RankCommand(op=RankOp.ANNOTATE, groups=encode_groups([group]))
        await self.thread.run(self.worker.annotate, group, command=command)
        return [write_group(group, Experience)]


# what `pipeline replay` and subclasses in other modules find here
SERVICE = CriticService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("critic", CriticService, argv)


if __name__ == "__main__":
    raise SystemExit(main())
