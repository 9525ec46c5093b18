"""Critic: values, KL-shaped rewards and advantages for each scored group, then trains."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline import codec
from pipeline.messages import Experience
from pipeline.runtime.service import Output, Service
from pipeline.samples import GroupArrays, read_group, write_group


def group_baseline(group: GroupArrays) -> None:
    """Stand-in advantages until the critic model is wired: score minus the group mean."""
    scores = np.array([s.score for s in group.samples], np.float32)
    baseline = scores.mean() if len(scores) else 0.0
    for sample, score in zip(group.samples, scores, strict=True):
        n = len(sample.response_ids)
        sample.extra["values"] = np.zeros(n, np.float32)
        sample.extra["advantages"] = np.full(n, score - baseline, np.float32)
        sample.extra["returns"] = np.full(n, score, np.float32)


class CriticService(Service):
    role = "critic"
    concurrency = 4

    @classmethod
    def follower(cls, ctx: Any) -> Any:
        """A critic rank other than 0 (torchrun): the value model's side of rank 0's work."""
        from pipeline.critic_worker import CriticWorker

        return CriticWorker(ctx)

    async def setup(self) -> None:
        self.worker = None
        if not self.config.run.standin:
            from pipeline.critic_worker import CriticWorker

            self.worker = CriticWorker(self.ctx)
            await self.worker.setup()

    async def teardown(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.close()

    async def handle(self, message: codec.Message) -> list[Output]:
        group = read_group(message)
        if self.worker is None:
            group_baseline(group)
        else:
            await self.worker.annotate(group)
        return [write_group(group, Experience)]


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("critic", CriticService, argv)


if __name__ == "__main__":
    raise SystemExit(main())
