"""A rollout without an engine: a fixed completion per prompt (its own last ids)."""

from __future__ import annotations

import numpy as np

from pipeline import codec
from pipeline.messages import Prompt, Rollout
from pipeline.runtime.service import Output
from pipeline.samples import GroupArrays, SampleArrays, write_group
from services.rollout import RolloutService


class StandinRollout(RolloutService):
    async def setup(self) -> None:
        self.engine = self.receiver = None

    async def handle(self, message: codec.Message) -> list[Output]:
        prompt: Prompt = message.body
        prompt_ids = message.tensor(prompt.prompt_ids)
        tail = prompt_ids[-min(len(prompt_ids), max(1, prompt.max_new_tokens)) :]
        version = self.ctx.control.policy_version if self.ctx.control else 0
        samples = [
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
        group = GroupArrays(
            uid=prompt.uid,
            prompt_ids=prompt_ids,
            samples=samples,
            data_source=prompt.data_source,
            ground_truth=prompt.ground_truth,
            released_version=prompt.released_version,
        )
        return [write_group(group, Rollout)]


SERVICE = StandinRollout


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("rollout", StandinRollout, argv)


if __name__ == "__main__":
    raise SystemExit(main())
