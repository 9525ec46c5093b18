"""The critic's model side: values, KL-shaped rewards and GAE advantages per group, value
updates, the KL controller, checkpoints; and the frozen reference when it lives here.

Every rank of a sharded critic (torchrun, `runtime/ranks.py`) runs these methods on the
same inputs in the same order: rank 0's service sends each call's command first, the other
ranks run `execute`. Each rank computes its strided shard of a group, the shards are summed
into the whole group on every rank, and every rank counts the same groups towards the next
value update, which they run (and checkpoint) together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import PipelineConfig
from pipeline.log import get_logger
from pipeline.runtime.checkpoint_clock import CheckpointClock
from pipeline.runtime.ranks import decode_groups
from pipeline.training.batch import ExperienceBatch
from pipeline.training.config import critic_config, reference_config
from pipeline.training.warm_up import Recompiles, warm_up
from pipeline.wire.messages import RankCommand, RankOp
from pipeline.wire.samples import GroupArrays

ANNOTATED = ("values", "advantages", "returns", "rewards")
# what a group carries on from the critic's own metrics (GroupArrays.stats)
_GROUP_STATS = (
    "kl/coef",
    "kl/reward_kl",
    "kl/reward_seq_kl",
    "kl/reward_penalty",
    "critic/values_mean",
)


def critic_parts(config: PipelineConfig, directory: Path) -> tuple[Any, Any]:
    """The value trainer and the reference where it is hosted here, warmed up (before the
    first group: every service warms up at once)."""
    import torch

    from pipeline.training import CriticTrainer
    from pipeline.training.reference import ReferencePolicy

    torch.set_num_threads(max(1, config.run.torch_threads))
    # whitening belongs to the learner, over the whole step's batch
    algorithm = dataclasses.replace(config.algorithm, whiten_advantages=False)
    trainer = CriticTrainer(str(directory), critic_config(config), algorithm)
    reference = None
    if config.reference_host() == "critic":
        ref = reference_config(config, trainer.config.device)
        reference = ReferencePolicy(str(directory), ref, dist=trainer.info)
    warm_up(get_logger("critic_worker"), config, [trainer, reference])
    return trainer, reference


def early_parts(config: PipelineConfig) -> tuple[Any, Any]:
    """`critic_parts` of a run whose model is a local directory (pipeline.runtime.early_build)."""
    return critic_parts(config, Path(config.model.path))


class CriticWorker:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger("critic_worker")
        self.checkpoints = Path(ctx.run_dir) / "checkpoints" / "critic"
        self._seen: list[GroupArrays] = []
        self.steps = 0  # value updates so far (restored by a resume)
        self.last_update: dict[str, float] = {}
        self.trainer: Any = None
        self.reference: Any = None
        self.kl_ctrl: Any = None
        self.recompiles = Recompiles()
        # every rank decides alike: by seconds only in one process (ranks' clocks differ);
        # the clock is the learner's (learner.checkpoint_every value updates, and seconds)
        learner = self.config.learner
        every_s = learner.checkpoint_every_s if getattr(ctx, "ranks", None) is None else 0.0
        self.clock = CheckpointClock(learner.checkpoint_every, every_s)

    def execute(self, command: RankCommand) -> None:
        """A rank other than 0: its part of one of rank 0's commands."""
        op = RankOp(command.op)
        if op == RankOp.SETUP:
            self.build(command.step)
        elif op == RankOp.ANNOTATE:
            self.annotate(decode_groups(command.groups))
        elif op == RankOp.CLOSE:
            self.save_last()
        else:
            raise ValueError(f"the critic has no part in {op.name}")

    def build(self, resume_step: int) -> None:
        """The value model (sharded when distributed), the reference where it is hosted
        here, the KL controller; resumed from checkpoint `resume_step` when >= 0. The
        parts built during the handshake when there are some (`early_parts`)."""
        from pipeline.algorithms.kl_controller import make_kl_controller
        from pipeline.tasks.prepare import model_dir
        from pipeline.training.distributed import log_sharding

        early = getattr(self.ctx, "early", None)
        parts = early.take(self.config) if early is not None else None
        taken = parts is not None
        if parts is None:
            parts = critic_parts(self.config, model_dir(self.config, Path(self.ctx.run_dir)))
        self.trainer, self.reference = parts
        self.kl_ctrl = make_kl_controller(self.config.algorithm)
        log_sharding(self.log, self.trainer)
        self.log.info("trainer_built", reference=self.reference is not None, early=taken)
        self.recompiles.mark()
        if resume_step >= 0:
            loaded = self.trainer.load_checkpoint(self.checkpoints, step=resume_step)
            self.steps = int(loaded.extra.get("steps", loaded.step))
            self.kl_ctrl.value = float(loaded.extra.get("kl_coef", self.kl_ctrl.value))
            self.last_update = dict(loaded.extra.get("last_update", {}))
            if self.trainer.info.rank == 0:
                self.log.info("resumed", step=self.steps, kl_coef=self.kl_ctrl.value)

    def annotate(
        self, groups: list[GroupArrays], annotated: Callable[[], None] | None = None
    ) -> tuple[float, float] | None:
        """Values, token rewards, advantages, returns (and reference log-probs when hosted
        here) into the groups' samples, in one forward; a value update once a step's worth
        has passed (the service never hands a batch that crosses one). Returns that
        update's wall-clock span, None without one.

        `annotated` is called once the groups are complete, before that update: the service
        sends them on then, so the learner's step does not wait for the critic's."""
        batch = ExperienceBatch.from_groups(groups)
        info = self.trainer.info
        local = batch.shard(info.rank, info.world_size) if info.world_size > 1 else batch
        fields = list(ANNOTATED)
        if self.reference is not None:
            local = local.replace(ref_logprobs=self.reference.logprobs(local))
            fields.append("ref_logprobs")
        local, metrics = self.trainer.compute_advantages(local, self.kl_ctrl)
        if info.world_size > 1:
            from pipeline.training.distributed import gather_strided_rows

            n, width = batch.num_samples, batch.max_response_len
            batch = batch.replace(
                **{name: gather_strided_rows(getattr(local, name), n, width) for name in fields}
            )
        else:
            batch = local
        by_uid = {s.uid: s for group in groups for s in group.samples}
        for name in fields:
            for uid, array in zip(batch.uids, batch.unpad(name), strict=True):
                by_uid[uid].extra[name] = np.asarray(array, np.float32)
        stats = {k: float(metrics[k]) for k in _GROUP_STATS if k in metrics}
        stats["critic/recompiles"] = self.recompiles.since()
        for group in groups:  # the forward's figures, in each of its groups
            group.stats.update(stats)
            group.stats.update(self.last_update)
        self._seen.extend(groups)
        if annotated is not None:
            annotated()
        if len(self._seen) < self.config.controller.prompts_per_step:
            return None
        start = time.time()
        self._update()
        return start, time.time()

    def _update(self) -> None:
        seen, self._seen = self._seen, []
        batch = ExperienceBatch.from_groups(seen)
        info = self.trainer.info
        if info.world_size > 1:
            batch = batch.shard(info.rank, info.world_size)
        metrics = self.trainer.train_step(batch)
        self.steps += 1
        self.last_update = {
            "critic/value_loss": float(metrics["critic/value_loss"]),
            "critic/updates": float(self.steps),
        }
        if info.rank == 0:
            self.log.info(
                "critic_step",
                step=self.steps,
                kl_coef=self.kl_ctrl.value,
                **{k: round(float(v), 5) for k, v in metrics.items()},
            )
        if self.clock.due(self.steps):
            self._save()

    def _save(self) -> None:
        extra = {
            "steps": self.steps,
            "kl_coef": self.kl_ctrl.value,
            "last_update": self.last_update,
        }
        self.trainer.save_checkpoint(
            self.checkpoints, extra=extra, keep_last=self.config.learner.keep_checkpoints
        )
        self.clock.saved(self.steps)

    def save_last(self) -> None:
        """At the end: a checkpoint of the last value update, unless it already has one."""
        if self.steps > 0 and self.clock.saved_count != self.steps:
            self._save()
