"""Learner side: turn sharded parameters into the bytes of one bucket.

For each bucket every FSDP rank casts its local shards of the bucket's tensors to the
rollout dtype while packing them into one flat buffer (cast BEFORE the gather: half the
bytes on the FSDP wire for bf16) and joins ONE `all_gather_into_tensor` per bucket on the
FSDP group, instead of one collective per tensor. FSDP2 shards dim 0 like `torch.chunk`
(ceil-sized chunks, trailing ranks possibly empty), so every rank knows every other rank's
row count and each rank's segment is padded to the same size. The full tensor is the
concatenation of the ranks' valid bytes; the sender copies chunk byte ranges out of it.

Tensors that are not FSDP-sharded are used as they are (plain tensors, replicated
DTensors) and cast while being copied into the bucket, with no intermediate copy; any other
DTensor layout falls back to `full_tensor()` (cast first; one collective each, in plan
order on every rank). A tensor split across buckets is gathered once, at its first bucket,
and kept until its last chunk is packed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipeline.errors import ConfigError
from pipeline.weights.plan import BucketPlan, Chunk


@dataclass
class _Sharded:
    """Where one FSDP-sharded tensor sits in its bucket's gather buffers."""

    name: str
    offset: int  # byte offset of this tensor inside each rank's segment
    row_bytes: int
    rows: list[int]  # valid rows per FSDP rank
    chunk_rows: int  # padded rows per rank


# the elements of a full tensor as consecutive 1-D pieces (one per FSDP rank, or one), in
# the rollout dtype or still in the parameter's dtype (then cast while packing)
Source = list[torch.Tensor]


class BucketGatherer:
    """Gathers full rollout-dtype bytes of each bucket's tensors on every learner rank."""

    def __init__(self, plan: BucketPlan, params: Mapping[str, torch.Tensor]) -> None:
        self.plan = plan
        self.params = params
        self.dtype = {s.name: s.dtype for s in plan.specs}
        self.group: dist.ProcessGroup | None = None
        self.world = 1
        self.rank = 0
        self._sharded: list[list[_Sharded]] = [[] for _ in plan.bucket_sizes]
        self._segment: list[int] = [0] * plan.num_buckets
        self._first: dict[str, int] = {}
        self._last: dict[str, int] = {}
        for c in plan.chunks:
            self._first.setdefault(c.name, c.bucket)
            self._last[c.name] = c.bucket
        self._kind: dict[str, str] = {}
        for spec in plan.specs:
            self._kind[spec.name] = self._classify(spec.name, params[spec.name])
        for spec in plan.specs:
            if self._kind[spec.name] != "fsdp":
                continue
            p = params[spec.name]
            d0 = spec.shape[0]
            chunk_rows = -(-d0 // self.world)
            row_bytes = (spec.nbytes // d0) if d0 else 0
            rows = [max(0, min(chunk_rows, d0 - r * chunk_rows)) for r in range(self.world)]
            local = cast(DTensor, p).to_local()
            if local.shape[0] != rows[self.rank]:
                raise ConfigError(
                    f"{spec.name}: local shard has {local.shape[0]} rows, expected "
                    f"{rows[self.rank]} (torch.chunk layout); unsupported FSDP sharding"
                )
            k = self._first[spec.name]
            off = -(-self._segment[k] // 16) * 16
            self._sharded[k].append(_Sharded(spec.name, off, row_bytes, rows, chunk_rows))
            self._segment[k] = -(-(off + chunk_rows * row_bytes) // 16) * 16
        self._carry: dict[str, Source] = {}

    def _classify(self, name: str, p: torch.Tensor) -> str:
        if not isinstance(p, DTensor):
            return "plain"
        if all(isinstance(pl, Replicate) for pl in p.placements):
            return "replicated"
        mesh = p.device_mesh
        if mesh.ndim == 1 and p.placements == (Shard(0),) and p.dim() > 0:
            group = mesh.get_group()
            if self.group is None:
                self.group = group
                self.world = mesh.size()
                self.rank = mesh.get_local_rank()
            elif group is not self.group:
                return "full_tensor"
            return "fsdp"
        return "full_tensor"

    def refresh(self, params: Mapping[str, torch.Tensor]) -> None:
        """Point at the current parameter objects (same names and shapes)."""
        for spec in self.plan.specs:
            if tuple(params[spec.name].shape) != spec.shape:
                raise ConfigError(f"{spec.name} changed shape since the weight plan was built")
        self.params = params

    @torch.no_grad()
    def gather(self, bucket: int) -> dict[str, Source]:
        """Full bytes of every tensor with a chunk in `bucket`. Collective on the FSDP
        group: every learner rank calls it for every bucket, in order."""
        out: dict[str, Source] = {}
        sharded = self._sharded[bucket]
        if sharded:
            out.update(self._gather_sharded(bucket, sharded))
        for c in self.plan.by_bucket[bucket]:
            if c.name in out or c.name in self._carry:
                continue
            kind = self._kind[c.name]
            if kind == "fsdp":
                continue
            p = self.params[c.name].detach()
            if kind == "replicated":
                p = cast(DTensor, p).to_local()
            elif kind == "full_tensor":
                p = cast(DTensor, p.to(self.dtype[c.name])).full_tensor()  # cast before the gather
            out[c.name] = [p.reshape(-1)]
        for name, src in out.items():
            if self._last[name] > bucket:
                self._carry[name] = src
        for c in self.plan.by_bucket[bucket]:
            if c.name in self._carry:
                out[c.name] = self._carry[c.name]
                if c.last:
                    del self._carry[c.name]
        return out

    def _gather_sharded(self, bucket: int, sharded: list[_Sharded]) -> dict[str, Source]:
        seg = self._segment[bucket]
        device = self.params[sharded[0].name].device
        inp = torch.empty(seg, dtype=torch.uint8, device=device)
        for s in sharded:
            local = cast(DTensor, self.params[s.name]).to_local()
            n = s.rows[self.rank] * s.row_bytes
            if n:
                dst = inp[s.offset : s.offset + n].view(self.dtype[s.name]).view(local.shape)
                dst.copy_(local.detach())  # the cast happens here, before the gather
        if self.world == 1:
            full = inp
        else:
            full = torch.empty(seg * self.world, dtype=torch.uint8, device=device)
            dist.all_gather_into_tensor(full, inp, group=self.group)
        out: dict[str, Source] = {}
        for s in sharded:
            out[s.name] = [
                full[r * seg + s.offset : r * seg + s.offset + s.rows[r] * s.row_bytes].view(
                    self.dtype[s.name]
                )
                for r in range(self.world)
                if s.rows[r]
            ]
        return out


def chunk_copies(
    source: Source, chunk: Chunk, dtype: torch.dtype, out: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) views that copy bytes [chunk.start, chunk.start + nbytes) of a
    full tensor into bucket `out`, cast to `dtype` by the copy (chunks start and end on
    element boundaries)."""
    item = dtype.itemsize
    dst = out[chunk.offset : chunk.offset + chunk.nbytes].view(dtype)
    lo, hi = chunk.start // item, (chunk.start + chunk.nbytes) // item
    pos = 0
    pairs = []
    for piece in source:
        n = piece.numel()
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            pairs.append((dst[a - lo : b - lo], piece[a - pos : b - pos]))
        pos += n
        if pos >= hi:
            break
    return pairs


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """All copies in one foreach call: a few multi-tensor kernels on the GPU instead of a
    launch (and its host time) per tensor, which shortens the learner's bucket phase over
    NCCL and CUDA IPC alike (weight_sync bench: docs/performance.md)."""
    if pairs:
        dsts, srcs = zip(*pairs, strict=True)
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)


def pack(
    gathered: Mapping[str, Source],
    chunks: tuple[Chunk, ...],
    dtypes: Mapping[str, torch.dtype],
    out: torch.Tensor,
) -> None:
    """Fill one bucket buffer from gathered sources."""
    pairs = []
    for chunk in chunks:
        pairs += chunk_copies(gathered[chunk.name], chunk, dtypes[chunk.name], out)
    copy_pairs(pairs)
