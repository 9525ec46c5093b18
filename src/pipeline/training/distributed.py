"""Process-group setup (torchrun-style env) and the few collectives the trainers need.

Every helper degrades to a no-op in a single process without a process group, so the same
trainer code runs under `python` and under `torchrun`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.errors import ConfigError
from pipeline.log import get_logger

log = get_logger("training.distributed")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size, local rank and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """ "cuda" -> cuda:LOCAL_RANK (of the devices this process sees); "cpu", "cuda:N" as
    given."""
    if spec != "cuda":
        return torch.device(spec)
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(
            "device cuda but this process sees no CUDA device: give its pool GPUs or make "
            "it a cpu pool"
        )
    return torch.device("cuda", local_rank % count)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as err:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from err


def init_distributed(
    backend: str | None = None,
    *,
    device: str,
    timeout_s: float = 1800.0,
) -> DistInfo:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK.

    Without WORLD_SIZE (or with 1) no group is created: single-process training needs none.
    The backend is nccl for CUDA devices and gloo otherwise, unless given.
    """
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise ConfigError(f"{key} is not set; launch with torchrun or export it")
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
        log.info("process group up", backend=backend, rank=rank, world_size=world)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def current_dist_info(device: str) -> DistInfo:
    """DistInfo of the existing default group (or of a single process without one)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
        return DistInfo(rank, world, local_rank, resolve_device(device, local_rank))
    return DistInfo(device=resolve_device(device, 0))


def teardown_distributed() -> None:
    """Destroy the default group if this process has one (idempotent).

    A barrier first: rank 0 hosts the TCP store, and a rank still talking to it when rank 0
    exits aborts (SIGABRT) instead of finishing cleanly.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def build_mesh(info: DistInfo) -> DeviceMesh | None:
    """1-D data-parallel mesh ("dp") over the default group; None in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the default group ("sum" or "max"); a no-op without one."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def all_reduce_ints(values: list[int], op: str = "sum") -> list[int]:
    """Element-wise all-reduce of a list of ints, in one collective."""
    if not is_distributed() or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=collective_device())
    return all_reduce_(t, op).tolist()


def gather_strided_rows(local: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
    """The whole batch of a per-sample field that each rank computed on its strided shard
    (`ExperienceBatch.shard`), on every rank: (num_rows, width) from this rank's (n_local,
    w <= width). Each rank fills its own rows of a zero tensor and the ranks sum them, which
    is exact."""
    if not is_distributed():
        return local
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.zeros(num_rows, width, dtype=local.dtype, device=collective_device())
    full[rank::world, : local.shape[1]] = local.to(full.device)
    return all_reduce_(full).cpu()


def collective_device() -> torch.device:
    """Where collective tensors must live for the default group's backend."""
    if is_distributed() and _uses_nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _uses_nccl() -> bool:
    return dist.get_backend() == "nccl"


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def sharded_params(model: torch.nn.Module) -> tuple[int, int]:
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
