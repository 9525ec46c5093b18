"""Reference: the frozen initial policy's log-probs of every response, for the KL terms.

Between reward and critic (or the learner without a critic): it adds `ref_logprobs` to
each scored group and passes it on, so the critic's KL-shaped reward and the learner's KL
loss read one computation, on devices of its own (`[services.reference]`, its own pool and
replicas; stateless, so a restart or another replica changes nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.runtime.ranks import TrainerThread
from pipeline.runtime.service import Output, Service
from pipeline.training.batch import ExperienceBatch
from pipeline.training.config import reference_config, role_device
from pipeline.training.warm_up import Recompiles, warm_up
from pipeline.wire import codec
from pipeline.wire.messages import Scored
from pipeline.wire.samples import GroupArrays, read_group, write_group


class ReferenceService(Service):
    role = "reference"
    concurrency = 2

    async def setup(self) -> None:
        self.thread = TrainerThread("reference")
        self.recompiles = Recompiles()
        self.reference: Any = await self.thread.run(self._build)
        self.recompiles.mark()

    def _build(self) -> Any:
        import torch

        from pipeline.tasks.prepare import model_dir
        from pipeline.training.reference import ReferencePolicy

        torch.set_num_threads(max(1, self.config.run.torch_threads))
        directory = model_dir(self.config, Path(self.ctx.run_dir))
        reference = ReferencePolicy(
            str(directory), reference_config(self.config, role_device(self.config, "reference"))
        )
        warm_up(self.log, self.config, [reference])  # before the first group
        return reference

    def _annotate(self, group: GroupArrays) -> None:
        batch = ExperienceBatch.from_groups([group])
        logprobs = batch.replace(ref_logprobs=self.reference.logprobs(batch))
        by_uid = {s.uid: s for s in group.samples}
        for uid, array in zip(batch.uids, logprobs.unpad("ref_logprobs"), strict=True):
            by_uid[uid].extra["ref_logprobs"] = np.asarray(array, np.float32)
        group.stats["reference/recompiles"] = self.recompiles.since()

    async def handle(self, message: codec.Message) -> list[Output]:
        group = read_group(message)
        await self.thread.run(self._annotate, group)
        return [write_group(group, Scored)]

    async def teardown(self) -> None:
        if hasattr(self, "thread"):
            self.thread.close()


# what `pipeline replay` and subclasses in other modules find here
SERVICE = ReferenceService


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("reference", ReferenceService, argv)
