"""Rollout: generates `n_samples` responses per prompt with the configured engine."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from pipeline import codec
from pipeline.messages import Prompt, Rollout
from pipeline.runtime.service import Output, Service
from pipeline.samples import GroupArrays, SampleArrays, write_group


def prompts_in_flight(config: Any) -> int:
    """rollout.prompts_in_flight, or by default: fill max_batch on a GPU, 8 on a CPU."""
    rollout = config.rollout
    if rollout.prompts_in_flight > 0:
        return int(rollout.prompts_in_flight)
    if config.pools[config.services["rollout"].pool].kind == "cuda":
        return max(1, rollout.max_batch // max(1, rollout.n_samples))
    return 8


class RolloutService(Service):
    role = "rollout"
    concurrency = 8

    async def setup(self) -> None:
        self.concurrency = prompts_in_flight(self.config)
        self.engine: Any = None
        self.receiver: Any = None
        if not self.config.run.standin:
            from pipeline.rollout_worker import start_engine
            from pipeline.weight_link import start_receiver

            self.engine = await start_engine(self.ctx)
            self.receiver = start_receiver(self.ctx, self.engine)

    def standin(self, prompt: Prompt, prompt_ids: np.ndarray) -> list[SampleArrays]:
        """Until an engine is configured: a fixed completion per prompt (its own ids)."""
        tail = prompt_ids[-min(len(prompt_ids), max(1, prompt.max_new_tokens)) :]
        version = self.ctx.control.policy_version if self.ctx.control else 0
        return [
            SampleArrays(
                uid=f"{prompt.uid}/{i}",
                response_ids=tail.astype(np.int32),
                behaviour_logprobs=np.zeros(len(tail), np.float32),
                token_versions=np.full(len(tail), max(0, version), np.int32),
                finish_reason="length",
                response_text=prompt.ground_truth[::-1],
            )
            for i in range(prompt.n_samples)
        ]

    async def handle(self, message: codec.Message) -> list[Output]:
        prompt: Prompt = message.body
        prompt_ids = message.tensor(prompt.prompt_ids)
        if self.engine is None:
            samples = self.standin(prompt, prompt_ids)
        else:
            samples = await self.engine.generate(prompt, prompt_ids)
        group = GroupArrays(
            uid=prompt.uid,
            prompt_ids=prompt_ids,
            samples=samples,
            data_source=prompt.data_source,
            ground_truth=prompt.ground_truth,
            released_version=prompt.released_version,
        )
        return [write_group(group, Rollout)]

    async def teardown(self) -> None:
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.stop)
        if self.engine is not None:
            await self.engine.close()


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("rollout", RolloutService, argv)


if __name__ == "__main__":
    raise SystemExit(main())
