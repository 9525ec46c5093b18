"""The learner service's trainer: PPO steps, checkpoints, weight publishing.

Training runs on a worker thread so heartbeats and acks keep flowing during a step.
A checkpoint is written before the step it ends is reported or its groups acknowledged,
and it carries that step's report (`TrainedStep`): a learner killed in between resumes
with weights that already include the step, so it settles the step from the checkpoint
(acknowledges its groups, reports it again) instead of training its groups twice.

Sharded (torchrun, `runtime/ranks.py`), every collective part (setup and resume, a train
step, a checkpoint, a publish, the last save) is a command rank 0 sends its other ranks
before it runs its own part; the other ranks run `execute`: the same code on the same
groups, each rank training on its strided shard of the step's batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from pipeline.log import get_logger
from pipeline.messages import RankCommand, RankOp, StepDone
from pipeline.runtime.ranks import TrainerThread, decode_groups, encode_groups, run_collective
from pipeline.samples import GroupArrays

T = TypeVar("T")


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


def groups_to_batch(groups: list[GroupArrays]) -> Any:
    """The samples of a step as an ExperienceBatch, in a fixed (uid) order."""
    import numpy as np

    from pipeline.training import ExperienceBatch

    samples = sorted(((g, s) for g in groups for s in g.samples), key=lambda pair: pair[1].uid)
    optional: dict[str, list[Any]] = {}
    for name in ("advantages", "returns", "values", "ref_logprobs"):
        if samples and all(name in s.extra for _, s in samples):
            optional[name] = [np.asarray(s.extra[name], np.float32) for _, s in samples]
    return ExperienceBatch.from_lists(
        [np.asarray(g.prompt_ids, np.int64) for g, _ in samples],
        [np.asarray(s.response_ids, np.int64) for _, s in samples],
        [np.asarray(s.behaviour_logprobs, np.float32) for _, s in samples],
        [float(s.score) for _, s in samples],
        uids=[s.uid for _, s in samples],
        token_versions=[np.asarray(s.token_versions, np.int64) for _, s in samples],
        **optional,
    )


def trainer_config(config: Any) -> Any:
    """The learner's trainer settings, with the sampler's temperature: PPO ratios and the
    mismatch metrics compare log-probs of the distribution the engine actually sampled
    (greedy engines report temperature-1 log-probs)."""
    import dataclasses

    temperature = config.rollout.temperature or 1.0
    return dataclasses.replace(config.learner.trainer, temperature=temperature)


def sharded_params(model: Any) -> tuple[int, int]:
    """(elements of the whole model, elements held on this rank): what FSDP split."""
    total = local = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return total, local


def log_sharding(log: Any, trainer: Any) -> None:
    """Log what FSDP split when a trainer spans several ranks (`model_sharded`)."""
    info = trainer.info
    if info.world_size > 1:
        total, local = sharded_params(trainer.model)
        log.info(
            "model_sharded",
            rank=info.rank,
            world_size=info.world_size,
            params=total,
            local_params=local,
        )


class LearnerWorker:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger("learner_worker")
        self.checkpoints = Path(ctx.run_dir) / "checkpoints" / "learner"
        self.step = 0
        self.trainer: Any = None
        self.publisher: Any = None
        # what the weights include last: from the checkpoint resumed, then each step trained
        self.last_step: TrainedStep | None = None
        # the other ranks of a sharded learner (None in one process); followers run execute
        self.ranks = ctx.ranks
        self.follows = self.ranks is not None and not self.ranks.is_leader
        self.thread = TrainerThread("learner")

    async def _run(self, run: Callable[[], T], command: Callable[[], RankCommand]) -> T:
        return await run_collective(self.ranks, run, command, self.thread)

    def execute(self, command: RankCommand) -> None:
        """A rank other than 0: its part of one of rank 0's commands."""
        op = RankOp(command.op)
        if op == RankOp.SETUP:
            self._build(command.step)
        elif op == RankOp.TRAIN:
            self._train(decode_groups(command.groups))
        elif op == RankOp.CHECKPOINT:
            self._save_now(json.loads(command.text))
        elif op == RankOp.PUBLISH:
            self._follow_publish(command.version)
        elif op == RankOp.CLOSE:
            self._close_now(json.loads(command.text))
        else:
            raise ValueError(f"the learner has no part in {op.name}")

    async def setup(self) -> None:
        from pipeline.training import latest_step

        # rank 0 decides where to resume: every rank loads that step
        resume = latest_step(self.checkpoints)
        step = -1 if resume is None else resume
        loaded = await self._run(
            lambda: self._build(step), lambda: RankCommand(op=RankOp.SETUP, step=step)
        )
        if loaded is not None:
            self.step = loaded.step
            if "trained_step" in loaded.extra:
                self.last_step = TrainedStep.from_json(loaded.extra["trained_step"])
            # the weights are this version, whatever the controller last heard
            self.ctx.policy_version = self.step
            self.log.info("resumed", step=self.step)
        if self.ctx.control is not None:  # not when replaying
            from pipeline.weight_link import make_publisher

            self.publisher = await make_publisher(self.ctx, self.trainer.model)

    def _build(self, resume_step: int) -> Any:
        """The trainer (sharded when distributed), resumed from `resume_step` if >= 0."""
        import torch

        from pipeline.tasks import model_dir
        from pipeline.training import PolicyTrainer

        torch.set_num_threads(max(1, self.config.run.torch_threads))
        directory = model_dir(self.config, Path(self.ctx.run_dir))
        self.trainer = PolicyTrainer(
            str(directory), trainer_config(self.config), self.config.algorithm
        )
        log_sharding(self.log, self.trainer)
        loaded = None
        if resume_step >= 0:
            loaded = self.trainer.load_checkpoint(self.checkpoints, step=resume_step)
            self.step = loaded.step
        if self.follows and self.config.replicas("rollout") > 0:
            from pipeline.weight_link import follower_publisher

            self.publisher = follower_publisher(self.config, self.trainer.model)
        return loaded

    async def train(self, groups: list[GroupArrays], step: int) -> dict[str, float]:
        return await self._run(
            lambda: self._train(groups),
            lambda: RankCommand(op=RankOp.TRAIN, step=step, groups=encode_groups(groups)),
        )

    def _train(self, groups: list[GroupArrays]) -> dict[str, float]:
        batch = groups_to_batch(groups)
        info = self.trainer.info
        if info.world_size > 1:
            batch = batch.shard(info.rank, info.world_size)
        metrics = self.trainer.train_step(batch)
        self.step = self.trainer.step
        return {k: float(v) for k, v in metrics.items()}

    async def checkpoint(self, trained: TrainedStep) -> None:
        """Note the step just trained; every `checkpoint_every` steps save with it. Call
        it before the step is reported or its groups acknowledged."""
        self.last_step = trained
        every = self.config.learner.checkpoint_every
        if every and self.step % every == 0:
            await self._save()

    def _extra(self) -> dict[str, Any]:
        return {} if self.last_step is None else {"trained_step": self.last_step.to_json()}

    async def _save(self) -> None:
        extra = self._extra()
        await self._run(
            lambda: self._save_now(extra),
            lambda: RankCommand(op=RankOp.CHECKPOINT, text=json.dumps(extra)),
        )

    def _save_now(self, extra: dict[str, Any]) -> None:
        self.trainer.save_checkpoint(
            self.checkpoints, extra=extra, keep_last=self.config.learner.keep_checkpoints
        )

    def relabel(self, version: int) -> None:
        """Serve the current weights as `version` (a resume behind the reported steps)."""
        self.ctx.policy_version = version
        if self.publisher is not None and hasattr(self.publisher, "version"):
            self.publisher.version = version  # what a (re)registering engine is sent

    async def publish(self, version: int) -> dict[str, float]:
        if self.publisher is None:
            return {}
        return await self.publisher.publish(version)

    def _follow_publish(self, version: int) -> None:
        from pipeline.errors import WeightSyncError

        if self.publisher is None:
            return
        try:
            self.publisher.publish(version)
        except WeightSyncError as exc:  # every rank raises it alike; rank 0 reports it
            self.log.warning("weight_sync_failed", version=version, error=str(exc))

    async def close(self) -> None:
        """Save where training ended: a checkpoint to resume from and an HF export."""
        if self.publisher is not None:
            await self.publisher.close()
        if self.trainer is None:
            return
        extra = self._extra()
        await self._run(
            lambda: self._close_now(extra),
            lambda: RankCommand(op=RankOp.CLOSE, text=json.dumps(extra)),
        )
        self.thread.close()
        if self.trainer.step > 0:
            self.log.info("saved", step=self.trainer.step)

    def _close_now(self, extra: dict[str, Any]) -> None:
        if self.follows and self.publisher is not None:
            self.publisher.close()
        if self.trainer.step > 0:
            self._save_now(extra)
            self.trainer.export_hf(Path(self.ctx.run_dir) / "final_model")
