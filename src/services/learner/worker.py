"""The learner's model side on every rank: the policy trainer, its checkpoints and its
weight publisher.

Rank 0's service (services/learner.py) owns the loop and runs these on its trainer thread,
sending a sharded learner's other ranks each call's command first (`TrainerThread`); the
other ranks run `execute`, which calls the same methods on the same inputs, so every rank
enters the same collectives in the same order. Each rank trains on its strided shard of
the step's batch (`rank_batch`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pipeline.config import PipelineConfig
from pipeline.log import get_logger
from pipeline.runtime.ranks import decode_groups
from pipeline.training.batch import ExperienceBatch
from pipeline.training.config import policy_config
from pipeline.training.warm_up import warm_up
from pipeline.wire.messages import RankCommand, RankOp, StepDone
from pipeline.wire.samples import GroupArrays, on_policy


@dataclass(frozen=True)
class TrainedStep:
    """The last step the weights include: the StepDone that was (or was about to be) sent
    for it (the same step, version and uids, so the controller knows it again; only the
    weight sync's metrics are missing) and the queue uids of the groups it trained on, to
    acknowledge if they are delivered again."""

    done: StepDone
    group_uids: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"done": msgspec.structs.asdict(self.done), "group_uids": list(self.group_uids)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainedStep:
        return cls(done=StepDone(**data["done"]), group_uids=list(data["group_uids"]))


def policy_parts(config: PipelineConfig, directory: Path) -> Any:
    """The run's policy trainer (and the reference when it is hosted here), warmed up
    (before the first batch: every service warms up at once)."""
    import torch

    from pipeline.training import PolicyTrainer

    torch.set_num_threads(max(1, config.run.torch_threads))
    trainer = PolicyTrainer(str(directory), policy_config(config), config.algorithm)
    warm_up(get_logger("learner_worker"), config, [trainer])
    return trainer


def early_parts(config: PipelineConfig) -> Any:
    """`policy_parts` of a run whose model is a local directory (pipeline.runtime.early_build)."""
    return policy_parts(config, Path(config.model.path))


class LearnerWorker:
    def __init__(self, ctx: Any, hub: Any = None) -> None:
        """`hub`: rank 0's WeightHub when engines take the weights (None on other ranks)."""
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger("learner_worker")
        self.checkpoints = Path(ctx.run_dir) / "checkpoints" / "learner"
        self.hub = hub
        self.trainer: Any = None
        # every rank's part of a weight update (rank 0's talks to the engines)
        self.publisher: Any = None

    def execute(self, command: RankCommand) -> None:
        """A rank other than 0: its part of one of rank 0's commands."""
        from pipeline.errors import WeightSyncError

        op = RankOp(command.op)
        if op == RankOp.SETUP:
            self.build(command.step)
        elif op == RankOp.TRAIN:
            groups = decode_groups(command.groups)
            fresh = on_policy(groups, command.version)
            batch = self.rank_batch(groups)
            self.trainer.submit_step(batch, on_policy=fresh, version=command.version).result()
        elif op == RankOp.CHECKPOINT:
            self.save(json.loads(command.text))
        elif op == RankOp.PUBLISH:
            try:
                self.publisher.publish(command.version)
            except WeightSyncError as exc:  # every rank raises it alike; rank 0 reports it
                self.log.warning("weight_sync_failed", version=command.version, error=str(exc))
        elif op == RankOp.CLOSE:
            self.close(json.loads(command.text))
        else:
            raise ValueError(f"the learner has no part in {op.name}")

    def build(self, resume_step: int) -> Any:
        """The trainer (sharded when distributed) and the weight publisher, resumed from
        checkpoint `resume_step` if >= 0 (its LoadedCheckpoint, else None); the trainer
        built during the handshake when there is one (`early_parts`)."""
        from pipeline.tasks.prepare import model_dir
        from pipeline.training.distributed import log_sharding

        early = getattr(self.ctx, "early", None)
        self.trainer = early.take(self.config) if early is not None else None
        taken = self.trainer is not None
        if self.trainer is None:
            self.trainer = policy_parts(self.config, model_dir(self.config, Path(self.ctx.run_dir)))
        log_sharding(self.log, self.trainer)
        self.log.info("trainer_built", reference=self.trainer.reference is not None, early=taken)
        loaded = None
        if resume_step >= 0:
            loaded = self.trainer.load_checkpoint(self.checkpoints, step=resume_step)
        # rank 0 without a hub is replaying: no engines to publish to
        if self.config.replicas("rollout") > 0 and (self.hub is not None or self.trainer.info.rank):
            from pipeline.weights.link import make_publisher

            weights = self.trainer.weights_to_publish()
            self.publisher = make_publisher(self.config, weights, self.hub)
        return loaded

    def rank_batch(self, groups: list[GroupArrays]) -> Any:
        """This rank's share of the step's batch."""
        batch = ExperienceBatch.from_groups(groups)
        info = self.trainer.info
        return batch.shard(info.rank, info.world_size) if info.world_size > 1 else batch

    def save(self, extra: dict[str, Any]) -> None:
        self.trainer.save_checkpoint(
            self.checkpoints, extra=extra, keep_last=self.config.learner.keep_checkpoints
        )

    def close(self, extra: dict[str, Any]) -> None:
        """Where training ended: a checkpoint to resume from and an HF export."""
        if self.publisher is not None and self.hub is None:
            self.publisher.close()  # rank 0's closes with its hub (LearnerWeights)
        if self.trainer.step > 0:
            self.save(extra)
            final = Path(self.ctx.run_dir) / "final_model"
            self.trainer.export_hf(final)
            if self.trainer.info.rank == 0:
                from pipeline.tasks.prepare import model_dir
                from pipeline.training.export import complete_hf_dir

                complete_hf_dir(model_dir(self.config, Path(self.ctx.run_dir)), final)
