"""Megatron-style tensor parallelism of a `CausalLM` for the engines, over a process group.

`shard_model` cuts a full model in place into one TP rank's share (the split of
weights/tp.py, which is also how updates are resharded for that rank):
  column-parallel q/k/v and gate/up projections: this rank's heads and MLP columns;
  row-parallel o_proj and down_proj: this rank's input columns, the partial outputs summed
  over the group (an all-reduce), then the replicated bias;
  vocab-parallel embedding (masked lookup, summed) and output layer (each rank's logits
  gathered along the vocabulary, so every rank holds the full logits and samples alike).
Norms stay replicated; the KV cache of a rank holds its heads only. Parameter names are the
full model's, with shard shapes. Collectives are torch's functional ones, which torch.compile
traces; NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError
from pipeline.models.attention import Attention
from pipeline.models.decoder import CausalLM
from pipeline.models.layers import SwiGLU
from pipeline.weights.tp import shard

# torch 2.13 renamed it (the GPU host's 2.11 has the old name only)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place in one engine replica's tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    # the CPU (gloo) group the leader's step plans go over (engines/tp_engine.py); None: the
    # default group
    control: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", self._group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dim, in rank order."""
        gathered = _all_gather(x.contiguous(), 0, self._group)  # (size * d0, ...)
        return torch.cat(gathered.chunk(self.size, dim=0), dim=-1)

    @property
    def _group(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: W holds this rank's input columns."""

    tp_group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp_group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the full table; ids outside look up zeros,
    and the ranks' lookups are summed."""

    tp_group: TPGroup
    start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp_group.all_reduce(out * inside[..., None].to(out.dtype))


class VocabParallelHead(nn.Linear):
    """Logits of this rank's vocabulary rows, gathered into the full vocabulary."""

    tp_group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_gather_last(F.linear(x, self.weight, self.bias))


def _divisible(what: str, n: int, size: int) -> None:
    if n % size:
        raise ConfigError(
            f"tensor parallelism over {size} ranks needs {what} divisible by {size} "
            f"(got {n}); choose a tp that divides it"
        )


def _cut(module: nn.Module, prefix: str, tp: TPGroup) -> None:
    """Replace module's parameters by this rank's slices (same names, shard shapes)."""
    for name, param in list(module.named_parameters(recurse=False)):
        part = shard(f"{prefix}.{name}", param.detach(), tp.rank, tp.size)
        setattr(module, name, nn.Parameter(part.contiguous().clone(), requires_grad=False))


def _retype(module: nn.Module, cls: type, tp: TPGroup) -> None:
    module.__class__ = cls
    module.tp_group = tp  # type: ignore[assignment]


@torch.no_grad()
def shard_model(model: CausalLM, tp: TPGroup) -> CausalLM:
    """Cut `model` (full weights, not yet fused) in place into rank `tp.rank`'s share."""
    if tp.size == 1:
        return model
    config = model.config
    _divisible("num_attention_heads", config.num_attention_heads, tp.size)
    _divisible("num_key_value_heads", config.num_key_value_heads, tp.size)
    _divisible("intermediate_size", config.intermediate_size, tp.size)
    _divisible("vocab_size", config.vocab_size, tp.size)
    tied = config.tie_word_embeddings
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            if module.qkv_weight is not None:
                raise ConfigError("shard_model before fuse_projections")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                _cut(getattr(module, proj), f"{name}.{proj}", tp)
            _retype(module.o_proj, RowParallelLinear, tp)
            module.num_heads //= tp.size
            module.num_kv_heads //= tp.size
        elif isinstance(module, SwiGLU):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                _cut(getattr(module, proj), f"{name}.{proj}", tp)
            _retype(module.down_proj, RowParallelLinear, tp)
    embed = model.model.embed_tokens
    _cut(embed, "model.embed_tokens", tp)
    _retype(embed, VocabParallelEmbedding, tp)
    embed.num_embeddings = embed.weight.shape[0]
    embed.start = tp.rank * embed.num_embeddings  # type: ignore[assignment]
    head = model.lm_head
    if tied:
        head.weight = embed.weight
    else:
        _cut(head, "lm_head", tp)
    _retype(head, VocabParallelHead, tp)
    head.out_features = head.weight.shape[0]
    return model


def local_heads(model: CausalLM) -> tuple[int, int]:
    """(query heads, key/value heads) each attention layer of `model` holds on this rank."""
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, Attention)
    return attn.num_heads, attn.num_kv_heads
