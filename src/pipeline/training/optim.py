"""AdamW, gradient-norm clipping (DTensor-aware) and warmup + constant/linear/cosine LR."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from pipeline.errors import ConfigError
from pipeline.training.config import TrainerConfig


def build_optimizer(model: nn.Module, config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters.

    On CUDA: the fused kernel for an unsharded model, foreach for FSDP2's DTensor shards; on
    CPU the plain per-parameter loop, which also keeps CPU runs bit-reproducible across
    checkpoint restarts. `trainer.fused_optimizer` overrides the choice (CPU has a fused
    kernel too).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = any(p.device.type == "cuda" for p in params)
    sharded = any(isinstance(p, DTensor) for p in params)
    fused = on_cuda and not sharded  # one kernel for all of an unsharded model's params
    if config.fused_optimizer is not None:
        if config.fused_optimizer and sharded:
            raise ConfigError("trainer.fused_optimizer=true needs an unsharded model (one rank)")
        fused = config.fused_optimizer
    optimizer = torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=on_cuda and not fused,
        fused=fused,
    )
    init_adam_state(optimizer)
    return optimizer


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's state (step 0, zero moments) exactly as its first step would.

    DCP's get_state_dict otherwise initialises an empty optimizer with a fake zero-lr step,
    which leaves step = 1: a checkpoint saved before the first update would then change
    the bias correction of every later update.
    """
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        fused = bool(group.get("fused"))  # the fused kernel keeps step on the device
        for p in group["params"]:
            if p.requires_grad and p not in optimizer.state:
                optimizer.state[p] = {
                    "step": torch.tensor(
                        0.0,
                        dtype=torch.float32 if fused else scalar,
                        device=p.device if fused else None,
                    ),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def lr_lambda(config: TrainerConfig) -> Callable[[int], float]:
    """LR multiplier per optimizer step: linear warmup to 1, then constant/linear/cosine decay
    to min_lr_ratio at total_steps. Warmup starts at 1/warmup (not 0) so no step is wasted."""
    warmup, total, floor = config.warmup_steps, config.total_steps, config.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if config.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainerConfig) -> LambdaLR:
    return LambdaLR(optimizer, lr_lambda(config))


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Clip gradients to `max_norm` (None: only measure) and return the total norm, a plain
    scalar tensor even for FSDP2 DTensor gradients (the all-reduce happens here).

    A non-finite norm is returned as is; the caller decides to skip the step.
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    limit = math.inf if max_norm is None else max_norm
    norm = torch.nn.utils.clip_grad_norm_(grads, limit, foreach=grads[0].device.type == "cuda")
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.detach()


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group runs the fused kernel (which takes a device-side scale and skip)."""
    return all(bool(group.get("fused")) for group in optimizer.param_groups)


def clip_scale_and_skip(
    norm: torch.Tensor, max_norm: float | None, bad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(grad_scale, found_inf) of a device-side guarded step: the divisor that clips to
    `max_norm` (None: no clipping), and 1.0 where the update must be skipped (`bad`, e.g. a
    non-finite loss, or a non-finite norm), as device tensors."""
    found_inf = (bad | ~torch.isfinite(norm)).to(torch.float32)
    if max_norm is None:
        return None, found_inf
    return torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0), found_inf


def guarded_step(
    optimizer: torch.optim.Optimizer,
    params: Iterable[nn.Parameter],
    max_norm: float | None,
    bad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip and step a fused optimizer with no host sync; returns (total norm, skipped flag)
    as device scalars for the caller to read later.

    The fused kernel divides every gradient by `grad_scale` (here 1 / the clip coefficient of
    `clip_grad_norm_`) and, when `found_inf` is set (`bad`, a non-finite loss, or a
    non-finite norm), leaves parameters, moments and step counts untouched: the skip that
    `TrainEngine.apply_gradients` decides on the host, decided on the device.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        zero = bad.new_zeros((), dtype=torch.float32)
        return zero, bad.to(torch.float32)
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    scale, found_inf = clip_scale_and_skip(norm, max_norm, bad)
    optimizer.grad_scale, optimizer.found_inf = scale, found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = optimizer.found_inf = None  # type: ignore[attr-defined]
    return norm.detach(), found_inf
