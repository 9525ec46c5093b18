"""Rollout: generates `n_samples` responses per prompt with the configured engine."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from pipeline.runtime.service import Output, Service
from pipeline.training.warm_up import Recompiles
from pipeline.wire import codec
from pipeline.wire.messages import Prompt, Rollout
from pipeline.wire.samples import GroupArrays, SampleArrays, write_group
from services.rollout.runner import prompts_in_flight


class RolloutService(Service):
    role = "rollout"
    concurrency = 8

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.recompiles = Recompiles()  # marked once the engine has warmed up
        self.episodes: Any = None  # an EpisodeDriver when an environment is configured
        self.env_pool: Any = None
        self.groups = 0

    async def setup(self) -> None:
        self.concurrency = prompts_in_flight(self.config)
        from pipeline.weights.link import runner_receiver
        from services.rollout.runner import start_engine

        self.engine: Any = await start_engine(self.ctx)
        self.receiver: Any = runner_receiver(self.ctx, self.engine)
        self.recompiles.mark()
        env = self.config.environment
        if env.name:
            from pipeline.envs.episode import EpisodeDriver
            from pipeline.envs.pool import EnvPool

            self.env_pool = await asyncio.to_thread(
                EnvPool,
                env.name,
                options=env.options,
                workers=env.workers,
                step_timeout_s=env.step_timeout_s,
            )
            self.episodes = EpisodeDriver(
                self.engine,
                self.engine.tokenizer,
                self.env_pool,
                self.config.environment,
                span=self.span,
                on_wait=self.room.set,
            )
            self.log.info("environment_ready", env=env.name, pids=self.env_pool.worker_pids)

    def occupied(self, running: int) -> int:
        """Groups whose every open episode waits on its environment leave the engine's
        batch to others: more prompts are taken meanwhile."""
        if self.episodes is None:
            return running
        return running - self.episodes.waiting_groups()

    @classmethod
    def follower(cls, ctx: Any) -> Any:
        """A TP engine replica's other ranks: their shards of the engine, in lockstep."""
        from services.rollout.runner import EngineFollower

        return EngineFollower(ctx)

    async def generate(self, prompt: Prompt, prompt_ids: np.ndarray) -> list[SampleArrays]:
        """The prompt's `n_samples` responses."""
        return await self.engine.generate(prompt, prompt_ids)

    async def handle(self, message: codec.Message) -> list[Output]:
        prompt: Prompt = message.body
        prompt_ids = message.tensor(prompt.prompt_ids)
        stats = {"rollout/recompiles": self.recompiles.since()}
        if self.episodes is not None:
            samples, episode_stats = await self.episodes.run_group(prompt, prompt_ids)
            stats.update(episode_stats)
            await self._report_env()
        else:
            samples = await self.generate(prompt, prompt_ids)
        if self.engine is not None:  # None: a stand-in without an engine (tests)
            stats.update(self.engine.engine_stats())
        group = GroupArrays(
            uid=prompt.uid,
            prompt_ids=prompt_ids,
            samples=samples,
            data_source=prompt.data_source,
            ground_truth=prompt.ground_truth,
            released_version=prompt.released_version,
            stats=stats,
            max_new_tokens=prompt.max_new_tokens,
        )
        return [write_group(group, Rollout)]

    async def _report_env(self) -> None:
        self.groups += 1
        if self.groups % 16 == 0:
            await self.report(self.groups, self.env_pool.counters.as_metrics("env."))

    async def teardown(self) -> None:
        if self.env_pool is not None:
            # the groups since the last report too, or a short run's counters never show;
            # into this service's metrics file only (the controller may be gone by now)
            if self.groups % 16:
                self.metrics.write(
                    {"step": self.groups, **self.env_pool.counters.as_metrics("env.")}
                )
            await asyncio.to_thread(self.env_pool.close)
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.stop)
        if self.engine is not None:
            await self.engine.close()


# what `pipeline replay` and subclasses in other modules find here
SERVICE = RolloutService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("rollout", RolloutService, argv)
