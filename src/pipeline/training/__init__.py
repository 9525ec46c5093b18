"""Training library: experience batches, micro-batching, FSDP2 policy/critic trainers,
optimisation, DCP checkpoints and HF export. Services wire it to the queues.

Names load lazily, so `pipeline.training.config` (and the run config that embeds it) stays
importable without pulling in torch and the models.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "BatchError": "pipeline.training.errors",
    "CheckpointStateError": "pipeline.training.errors",
    "CriticTrainer": "pipeline.training.critic_trainer",
    "DistInfo": "pipeline.training.distributed",
    "ExperienceBatch": "pipeline.training.batch",
    "LoadedCheckpoint": "pipeline.training.checkpoint",
    "MicroBatch": "pipeline.training.micro_batching",
    "PendingStep": "pipeline.training.policy_trainer",
    "PolicyTrainer": "pipeline.training.policy_trainer",
    "TrainerConfig": "pipeline.training.config",
    "TrainingError": "pipeline.training.errors",
    "build_mesh": "pipeline.training.distributed",
    "build_optimizer": "pipeline.training.optim",
    "build_scheduler": "pipeline.training.optim",
    "clip_grad_norm": "pipeline.training.optim",
    "current_dist_info": "pipeline.training.distributed",
    "export_hf": "pipeline.training.export",
    "global_whiten": "pipeline.training.advantages",
    "group_advantages": "pipeline.training.advantages",
    "group_ids_from_uids": "pipeline.training.batch",
    "init_distributed": "pipeline.training.distributed",
    "latest_step": "pipeline.training.checkpoint",
    "load_checkpoint": "pipeline.training.checkpoint",
    "pack_padded": "pipeline.training.micro_batching",
    "pack_padding_free": "pipeline.training.micro_batching",
    "plan_micro_batches": "pipeline.training.micro_batching",
    "plan_step": "pipeline.training.micro_batching",
    "save_checkpoint": "pipeline.training.checkpoint",
    "teardown_distributed": "pipeline.training.distributed",
    "token_rewards": "pipeline.training.advantages",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline.training' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BatchError",
    "CheckpointStateError",
    "CriticTrainer",
    "DistInfo",
    "ExperienceBatch",
    "LoadedCheckpoint",
    "MicroBatch",
    "PendingStep",
    "PolicyTrainer",
    "TrainerConfig",
    "TrainingError",
    "build_mesh",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
    "current_dist_info",
    "export_hf",
    "global_whiten",
    "group_advantages",
    "group_ids_from_uids",
    "init_distributed",
    "latest_step",
    "load_checkpoint",
    "pack_padded",
    "pack_padding_free",
    "plan_micro_batches",
    "plan_step",
    "save_checkpoint",
    "teardown_distributed",
    "token_rewards",
]
