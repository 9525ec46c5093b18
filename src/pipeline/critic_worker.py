"""The critic service's model: values and GAE advantages per group, trained on returns.

Advantages are computed per group as it arrives (so the learner is never waiting on a
whole batch here); the value model trains once a step's worth of groups has passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.learner_worker import groups_to_batch
from pipeline.log import get_logger
from pipeline.samples import GroupArrays


class CriticWorker:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger("critic_worker")
        self._seen: list[GroupArrays] = []
        self._lock = asyncio.Lock()
        self.steps = 0

    async def setup(self) -> None:
        import torch

        from pipeline.algorithms.kl_controller import make_kl_controller
        from pipeline.tasks import model_dir
        from pipeline.training import CriticTrainer

        torch.set_num_threads(max(1, self.config.run.torch_threads))
        directory = model_dir(self.config, Path(self.ctx.run_dir))
        # whitening belongs to the learner, over the whole step's batch
        algorithm = dataclasses.replace(self.config.algorithm, whiten_advantages=False)
        self.trainer = await asyncio.to_thread(  # off the loop, like the learner's
            CriticTrainer, str(directory), self.config.critic.trainer, algorithm
        )
        self.kl_ctrl = make_kl_controller(self.config.algorithm)

    async def annotate(self, group: GroupArrays) -> None:
        batch = groups_to_batch([group])
        async with self._lock:
            batch, _ = await asyncio.to_thread(self.trainer.compute_advantages, batch, self.kl_ctrl)
        by_uid = {s.uid: s for s in group.samples}
        for name in ("values", "advantages", "returns"):
            for uid, array in zip(batch.uids, batch.unpad(name), strict=True):
                by_uid[uid].extra[name] = np.asarray(array, np.float32)
        self._seen.append(group)
        if len(self._seen) >= self.config.controller.prompts_per_step:
            seen, self._seen = self._seen, []
            train_batch = groups_to_batch(seen)
            async with self._lock:
                metrics = await asyncio.to_thread(self.trainer.train_step, train_batch)
            self.steps += 1
            self.log.info(
                "critic_step",
                step=self.steps,
                **{k: round(float(v), 5) for k, v in metrics.items()},
            )
