"""The learner service's trainer: PPO steps, checkpoints, weight publishing.

Training runs on a worker thread so heartbeats and acks keep flowing during a step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pipeline.log import get_logger
from pipeline.samples import GroupArrays


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


class LearnerWorker:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger("learner_worker")
        self.checkpoints = Path(ctx.run_dir) / "checkpoints" / "learner"
        self.step = 0
        self.publisher: Any = None

    async def setup(self) -> None:
        import torch

        from pipeline.tasks import model_dir
        from pipeline.training import PolicyTrainer, latest_step

        torch.set_num_threads(max(1, self.config.run.torch_threads))
        directory = model_dir(self.config, Path(self.ctx.run_dir))
        # off the event loop: loading a real model takes longer than the heartbeat timeout
        self.trainer = await asyncio.to_thread(
            PolicyTrainer, str(directory), trainer_config(self.config), self.config.algorithm
        )
        if latest_step(self.checkpoints) is not None:
            loaded = await asyncio.to_thread(self.trainer.load_checkpoint, self.checkpoints)
            self.step = loaded.step
            self.log.info("resumed", step=self.step)
        if self.ctx.control is not None:  # not when replaying
            from pipeline.weight_link import make_publisher

            self.publisher = await make_publisher(self.ctx, self.trainer.model)

    async def train(self, groups: list[GroupArrays], step: int) -> dict[str, float]:
        batch = groups_to_batch(groups)
        metrics = await asyncio.to_thread(self.trainer.train_step, batch)
        self.step = self.trainer.step
        every = self.config.learner.checkpoint_every
        if every and self.step % every == 0:
            await asyncio.to_thread(
                self.trainer.save_checkpoint,
                self.checkpoints,
                keep_last=self.config.learner.keep_checkpoints,
            )
        return {k: float(v) for k, v in metrics.items()}

    async def publish(self, version: int) -> dict[str, float]:
        if self.publisher is None:
            return {}
        return await self.publisher.publish(version)

    async def close(self) -> None:
        """Save where training ended: a checkpoint to resume from and an HF export."""
        if self.publisher is not None:
            await self.publisher.close()
        if self.trainer.step > 0:
            await asyncio.to_thread(
                self.trainer.save_checkpoint,
                self.checkpoints,
                keep_last=self.config.learner.keep_checkpoints,
            )
            await asyncio.to_thread(self.trainer.export_hf, Path(self.ctx.run_dir) / "final_model")
            self.log.info("saved", step=self.trainer.step)
