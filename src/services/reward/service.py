"""Reward: scores every sample with the verifier for its data source, never crashing on one."""

from __future__ import annotations

import msgspec

from pipeline.runtime.service import Output, Service
from pipeline.wire import codec
from pipeline.wire.messages import Scored
from pipeline.wire.samples import read_group, write_group

ENVIRONMENT = "environment"


class RewardService(Service):
    role = "reward"
    concurrency = 4

    async def setup(self) -> None:
        from pipeline.rewards.scorer import RewardScorer

        self.step = 0
        # multi-turn: an episode's score is what its environment returned; kept as it is
        self.keep_episode_return = self.config.reward.function == ENVIRONMENT
        if self.keep_episode_return:
            return
        self.scorer = RewardScorer(
            self.config.reward.function, timeout_s=self.config.reward.timeout_s
        )

    async def handle(self, message: codec.Message) -> list[Output]:
        from pipeline.rewards.types import ScoreItem

        group = read_group(message)
        if self.keep_episode_return:
            return [write_group(group, Scored)]
        items = [
            ScoreItem(
                uid=s.uid,
                data_source=group.data_source,
                solution_str=s.response_text,
                ground_truth=group.ground_truth,
            )
            for s in group.samples
        ]
        results = await self.scorer.score_batch(items)
        for sample, result in zip(group.samples, results, strict=True):
            sample.score = float(result.score)
            group.reward_errors += int(result.status != "ok")
        self.step += 1
        if self.step % 16 == 0:
            counters = msgspec.structs.asdict(self.scorer.counters)
            await self.report(self.step, {f"reward.{k}": float(v) for k, v in counters.items()})
        return [write_group(group, Scored)]

    async def teardown(self) -> None:
        if hasattr(self, "scorer"):
            self.scorer.close()


# what `pipeline replay` and subclasses in other modules find here
SERVICE = RewardService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("reward", RewardService, argv)
