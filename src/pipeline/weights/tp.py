"""Tensor-parallel slicing of Llama / Qwen parameters for engines that shard their weights.

Over gloo and NCCL the learner sends each TP engine rank only its shards
(`weights/reshard.py`), from rank 0 or from each striped sender; over CUDA IPC it publishes
full tensors and each rank keeps its slice (`Staging`). The split follows Megatron-style layers as vLLM shards them:
  column-parallel (split the output dim 0): q/k/v/gate/up projections (weights and biases)
  row-parallel (split the input dim 1): o_proj / down_proj weights; their biases replicated
  vocab-parallel (dim 0): embed_tokens, lm_head
  replicated: every norm (input/post-attention/final, qwen3 q_norm/k_norm)
A name matching no rule is refused instead of guessed, since a wrong guess would load a
plausible but wrong slice. Splits must be even (no vocab padding, no KV-head replication
when num_key_value_heads < tp_size).
"""

from __future__ import annotations

import re

import torch

from pipeline.errors import ConfigError

_RULES: tuple[tuple[re.Pattern[str], int | None], ...] = (
    (re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$"), 0),
    (re.compile(r"\.(o_proj|down_proj)\.weight$"), 1),
    (re.compile(r"\.(o_proj|down_proj)\.bias$"), None),
    (re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$"), 0),
    (re.compile(r"norm\.weight$"), None),
)


def split_dim(name: str) -> int | None:
    """The dim a parameter is split along under TP, None when replicated."""
    for pattern, dim in _RULES:
        if pattern.search(name):
            return dim
    raise ConfigError(f"no tensor-parallel rule for parameter {name!r}")


def full_shape(name: str, shard_shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """Full shape of a parameter given one TP rank's shard shape."""
    if tp_size == 1:
        return tuple(shard_shape)
    dim = split_dim(name)
    if dim is None:
        return tuple(shard_shape)
    if dim >= len(shard_shape):
        raise ConfigError(f"{name}: cannot split dim {dim} of shape {tuple(shard_shape)}")
    out = list(shard_shape)
    out[dim] *= tp_size
    return tuple(out)


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """View of tp_rank's slice of a full parameter (no copy)."""
    if tp_size == 1:
        return full
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank={tp_rank} outside [0, {tp_size})")
    dim = split_dim(name)
    if dim is None:
        return full
    size = full.shape[dim]
    if size % tp_size:
        raise ConfigError(f"{name}: dim {dim} of size {size} does not split over tp={tp_size}")
    step = size // tp_size
    return full.narrow(dim, tp_rank * step, step)
