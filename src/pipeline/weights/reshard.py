"""Resharded buckets: each tensor-parallel engine rank gets only its own shards.

The learner gathers each bucket of the full plan as always (`BucketGatherer`); for every TP
layout (rank r of a T-way split) among the engines it then packs a bucket of its own, the
r-th shards (`weights/tp.py`) of the tensors whose first chunk lies in that full bucket (a
tensor split over several full buckets is whole from its first one on), and sends it to
the engines of that layout alone. Bucket k of a layout's plan therefore pairs with bucket
k of the full plan; it may be empty (then nothing is sent). A rank receives about 1/T of
the full bytes: the replicated tensors (norms, row-parallel biases) come whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from pipeline.weights import tp
from pipeline.weights.gather import Source, copy_pairs
from pipeline.weights.plan import BucketPlan, Chunk, TensorSpec


def shard_shape(name: str, shape: tuple[int, ...], tp_rank: int, tp_size: int) -> tuple[int, ...]:
    dim = tp.split_dim(name)
    if dim is None or tp_size == 1:
        return shape
    out = list(shape)
    out[dim] //= tp_size
    return tuple(out)


def shard_plan(plan: BucketPlan, tp_rank: int, tp_size: int, *, align: int = 256) -> BucketPlan:
    """The buckets of TP rank `tp_rank` of `tp_size`, aligned to the full plan's buckets."""
    by_name = {s.name: s for s in plan.specs}
    specs, chunks = [], []
    sizes = [0] * plan.num_buckets
    seen: set[str] = set()
    for chunk in plan.chunks:
        if chunk.name in seen:
            continue
        seen.add(chunk.name)
        full = by_name[chunk.name]
        # a split that does not divide evenly is refused here, before any byte moves
        tp.shard(chunk.name, torch.empty(full.shape, device="meta"), tp_rank, tp_size)
        spec = TensorSpec(
            full.name, shard_shape(full.name, full.shape, tp_rank, tp_size), full.dtype
        )
        k = chunk.bucket
        offset = -(-sizes[k] // align) * align
        specs.append(spec)
        chunks.append(Chunk(spec.name, k, offset, spec.nbytes, 0, True))
        sizes[k] = offset + spec.nbytes
    return BucketPlan(tuple(specs), tuple(chunks), tuple(sizes), plan.bucket_bytes)


def _shard_copies(
    source: Source, full: TensorSpec, dst: torch.Tensor, tp_rank: int, tp_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) views that copy rank `tp_rank`'s shard of a full tensor given
    as consecutive row blocks (one per FSDP rank, or one) into `dst` (the shard's shape)."""
    dim = tp.split_dim(full.name) if tp_size > 1 else None
    row = math.prod(full.shape[1:]) if len(full.shape) > 1 else 1
    rest = full.shape[1:]
    if dim == 0:
        step = full.shape[0] // tp_size
        lo, hi = tp_rank * step, (tp_rank + 1) * step
    pairs = []
    pos = 0
    for piece in source:
        rows = piece.numel() // row if row else 0
        block = piece.view(rows, *rest)
        if dim is None:
            pairs.append((dst[pos : pos + rows], block))
        elif dim == 0:
            a, b = max(lo, pos), min(hi, pos + rows)
            if a < b:
                pairs.append((dst[a - lo : b - lo], block[a - pos : b - pos]))
        else:  # dim 1: every row's columns of this rank
            cols = full.shape[1] // tp_size
            pairs.append((dst[pos : pos + rows], block[:, tp_rank * cols : (tp_rank + 1) * cols]))
        pos += rows
    return pairs


def pack_shards(
    gathered: Mapping[str, Source],
    plan: BucketPlan,
    full: Mapping[str, TensorSpec],
    bucket: int,
    tp_rank: int,
    tp_size: int,
    out: torch.Tensor,
) -> None:
    """Fill one bucket of a layout's plan (`shard_plan`) from the full bucket's sources."""
    pairs = []
    specs = {s.name: s for s in plan.specs}
    for chunk in plan.by_bucket[bucket]:
        spec = specs[chunk.name]
        dst = out[chunk.offset : chunk.offset + chunk.nbytes].view(spec.dtype).view(spec.shape)
        pairs += _shard_copies(gathered[chunk.name], full[chunk.name], dst, tp_rank, tp_size)
    copy_pairs(pairs)
