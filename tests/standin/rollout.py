"""A rollout without an engine: a fixed completion per prompt (its own last ids)."""

from __future__ import annotations

import numpy as np

from pipeline.wire.messages import Prompt
from pipeline.wire.samples import SampleArrays
from services.rollout.service import RolloutService
from tests.standin import service_main


class StandinRollout(RolloutService):
    async def setup(self) -> None:
        self.engine = self.receiver = None

    async def generate(self, prompt: Prompt, prompt_ids: np.ndarray) -> list[SampleArrays]:
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


SERVICE = StandinRollout

main = service_main("rollout", StandinRollout)


if __name__ == "__main__":
    raise SystemExit(main())
