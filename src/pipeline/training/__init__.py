"""Training library: experience batches, micro-batching, FSDP2 policy/critic trainers,
optimisation, DCP checkpoints and HF export. Services wire it to the queues."""

from pipeline.training.advantages import global_whiten, group_advantages, token_rewards
from pipeline.training.batch import ExperienceBatch, group_ids_from_uids
from pipeline.training.checkpoint import (
    LoadedCheckpoint,
    latest_step,
    load_checkpoint,
    save_checkpoint,
)
from pipeline.training.config import TrainerConfig
from pipeline.training.critic_trainer import CriticTrainer
from pipeline.training.distributed import (
    DistInfo,
    build_mesh,
    current_dist_info,
    init_distributed,
    teardown_distributed,
)
from pipeline.training.errors import BatchError, CheckpointStateError, TrainingError
from pipeline.training.export import export_hf
from pipeline.training.micro_batching import (
    MicroBatch,
    pack_padded,
    pack_padding_free,
    plan_micro_batches,
    plan_step,
)
from pipeline.training.optim import build_optimizer, build_scheduler, clip_grad_norm
from pipeline.training.policy_trainer import PolicyTrainer

__all__ = [
    "BatchError",
    "CheckpointStateError",
    "CriticTrainer",
    "DistInfo",
    "ExperienceBatch",
    "LoadedCheckpoint",
    "MicroBatch",
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
