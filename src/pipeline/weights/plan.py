"""Bucket layout of a weight update: which bytes of which tensor go where.

The plan is computed from (name, shape, dtype) in ONE fixed order (the model's
`named_parameters` order) so that every learner rank and every engine derives the same
buckets without talking. Entries are aligned inside a bucket (vectorised copies on GPU).

A tensor larger than a bucket is split across consecutive buckets as several `WeightEntry`
rows with the same name, in order: the first chunk starts at its bucket's offset, every
later chunk starts at offset 0 of the next bucket, and the chunks' `nbytes` add up to the
tensor's size. The byte position of a chunk inside the full tensor is therefore the sum of
the `nbytes` of the chunks before it, so the wire format needs no extra field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from pipeline.errors import ConfigError
from pipeline.wire.messages import WeightEntry

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire spelling of a torch dtype ("bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"dtype {dtype} cannot travel in a weight update")
    return name


def parse_dtype(name: str) -> torch.dtype | None:
    """torch dtype of a wire name, None when unknown (the caller reports it)."""
    return _DTYPES.get(name)


@dataclass(frozen=True)
class TensorSpec:
    """A full (unsharded) tensor as the engines see it: rollout dtype, global shape."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, start + nbytes) of tensor `name` at `offset` of bucket `bucket`."""

    name: str
    bucket: int
    offset: int
    nbytes: int
    start: int
    last: bool  # the final chunk of its tensor


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


@dataclass(frozen=True)
class BucketPlan:
    specs: tuple[TensorSpec, ...]
    chunks: tuple[Chunk, ...]
    bucket_sizes: tuple[int, ...]
    bucket_bytes: int

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def max_bucket(self) -> int:
        return max(self.bucket_sizes, default=0)

    @cached_property
    def by_bucket(self) -> tuple[tuple[Chunk, ...], ...]:
        """Chunks grouped per bucket, in plan order."""
        groups: list[list[Chunk]] = [[] for _ in self.bucket_sizes]
        for chunk in self.chunks:
            groups[chunk.bucket].append(chunk)
        return tuple(tuple(g) for g in groups)

    def spec(self, name: str) -> TensorSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def entries(self) -> list[WeightEntry]:
        """`WeightMeta.entries`, one per chunk in plan order."""
        by_name = {s.name: s for s in self.specs}
        out = []
        for chunk in self.chunks:
            spec = by_name[chunk.name]
            out.append(
                WeightEntry(
                    name=chunk.name,
                    dtype=dtype_name(spec.dtype),
                    shape=spec.shape,
                    bucket=chunk.bucket,
                    offset=chunk.offset,
                    nbytes=chunk.nbytes,
                )
            )
        return out

    @classmethod
    def build(
        cls,
        specs: Sequence[TensorSpec],
        *,
        bucket_bytes: int = 1 << 30,
        align: int = 256,
    ) -> BucketPlan:
        """Greedy packing in the given order; a tensor that does not fit the remaining space
        opens a new bucket; one larger than a whole bucket starts a fresh bucket and spans
        as many as it needs (its tail bucket is then shared with the tensors after it)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"duplicate parameter names in the weight plan: {dup}")
        chunks: list[Chunk] = []
        sizes: list[int] = []
        used = 0  # bytes used in the current (last) bucket
        for spec in specs:
            n = spec.nbytes
            item = spec.dtype.itemsize
            if bucket_bytes < item:
                raise ConfigError(f"bucket_bytes={bucket_bytes} is smaller than one element")
            if not sizes:
                sizes.append(0)
            off = _align_up(used, align)
            if off + n <= bucket_bytes:
                chunks.append(Chunk(spec.name, len(sizes) - 1, off, n, 0, True))
                used = off + n
                sizes[-1] = used
                continue
            if n <= bucket_bytes:
                sizes.append(n)
                chunks.append(Chunk(spec.name, len(sizes) - 1, 0, n, 0, True))
                used = n
                continue
            if used > 0:
                sizes.append(0)
            start = 0
            while start < n:
                take = min(n - start, bucket_bytes - bucket_bytes % item)
                last = start + take == n
                chunks.append(Chunk(spec.name, len(sizes) - 1, 0, take, start, last))
                sizes[-1] = take
                start += take
                if not last:
                    sizes.append(0)
            used = sizes[-1]
        return cls(tuple(specs), tuple(chunks), tuple(sizes), bucket_bytes)


def chunks_of(entries: Sequence[WeightEntry]) -> list[Chunk]:
    """Chunks of received entries: the in-tensor position is the running sum per name."""
    seen: dict[str, int] = {}
    totals: dict[str, int] = {}
    for e in entries:
        totals[e.name] = totals.get(e.name, 0) + e.nbytes
    out = []
    for e in entries:
        start = seen.get(e.name, 0)
        seen[e.name] = start + e.nbytes
        out.append(
            Chunk(e.name, e.bucket, e.offset, e.nbytes, start, seen[e.name] == totals[e.name])
        )
    return out
