"""The critic service's model: values and GAE advantages per group, trained on returns.

Advantages are computed per group as it arrives (so the learner is never waiting on a
whole batch here); the value model trains once a step's worth of groups has passed.
Sharded (torchrun, `runtime/ranks.py`), rank 0 sends its other ranks each group before it
annotates it: every rank computes its strided shard of the group, the shards are summed
into the whole group on every rank, and every rank counts the same groups towards the
next value update, which they then run together.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline.learner_worker import groups_to_batch
from pipeline.log import get_logger
from pipeline.messages import RankCommand, RankOp
from pipeline.runtime.ranks import TrainerThread, decode_groups, encode_groups, run_collective
from pipeline.samples import GroupArrays

T = TypeVar("T")
ANNOTATED = ("values", "advantages", "returns")


class CriticWorker:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger("critic_worker")
        self._seen: list[GroupArrays] = []
        self._lock = asyncio.Lock()
        self.steps = 0
        # the other ranks of a sharded critic (None in one process)
        self.ranks = ctx.ranks
        self.thread = TrainerThread("critic")

    async def _run(self, run: Callable[[], T], command: Callable[[], RankCommand]) -> T:
        """One collective part at a time, on the trainer's thread (sharded: rank 0 first
        sends the other ranks the command that makes them run the same)."""
        async with self._lock:
            return await run_collective(self.ranks, run, command, self.thread)

    def close(self) -> None:
        """Stop the trainer's thread (it holds nothing once the loop stops calling it)."""
        self.thread.close()

    def execute(self, command: RankCommand) -> None:
        """A rank other than 0: its part of one of rank 0's commands."""
        op = RankOp(command.op)
        if op == RankOp.SETUP:
            self._build()
        elif op == RankOp.ANNOTATE:
            (group,) = decode_groups(command.groups)
            self._annotate(group)
        else:
            raise ValueError(f"the critic has no part in {op.name}")

    async def setup(self) -> None:
        # off the loop, like the learner's
        await self._run(self._build, lambda: RankCommand(op=RankOp.SETUP))

    def _build(self) -> None:
        import torch

        from pipeline.algorithms.kl_controller import make_kl_controller
        from pipeline.tasks import model_dir
        from pipeline.training import CriticTrainer

        torch.set_num_threads(max(1, self.config.run.torch_threads))
        directory = model_dir(self.config, Path(self.ctx.run_dir))
        # whitening belongs to the learner, over the whole step's batch
        algorithm = dataclasses.replace(self.config.algorithm, whiten_advantages=False)
        self.trainer = CriticTrainer(str(directory), self.config.critic.trainer, algorithm)
        self.kl_ctrl = make_kl_controller(self.config.algorithm)
        from pipeline.learner_worker import log_sharding

        log_sharding(self.log, self.trainer)

    async def annotate(self, group: GroupArrays) -> None:
        await self._run(
            lambda: self._annotate(group),
            lambda: RankCommand(op=RankOp.ANNOTATE, groups=encode_groups([group])),
        )

    def _annotate(self, group: GroupArrays) -> None:
        batch = groups_to_batch([group])
        info = self.trainer.info
        if info.world_size > 1:
            from pipeline.training.distributed import gather_strided_rows

            local, _ = self.trainer.compute_advantages(
                batch.shard(info.rank, info.world_size), self.kl_ctrl
            )
            n, width = batch.num_samples, batch.max_response_len
            batch = batch.replace(
                **{name: gather_strided_rows(getattr(local, name), n, width) for name in ANNOTATED}
            )
        else:
            batch, _ = self.trainer.compute_advantages(batch, self.kl_ctrl)
        by_uid = {s.uid: s for s in group.samples}
        for name in ANNOTATED:
            for uid, array in zip(batch.uids, batch.unpad(name), strict=True):
                by_uid[uid].extra[name] = np.asarray(array, np.float32)
        self._seen.append(group)
        if len(self._seen) >= self.config.controller.prompts_per_step:
            seen, self._seen = self._seen, []
            train_batch = groups_to_batch(seen)
            if info.world_size > 1:
                train_batch = train_batch.shard(info.rank, info.world_size)
            metrics = self.trainer.train_step(train_batch)
            self.steps += 1
            if info.rank == 0:
                self.log.info(
                    "critic_step",
                    step=self.steps,
                    **{k: round(float(v), 5) for k, v in metrics.items()},
                )
