"""Engine-side check of WeightMeta against the engine's own parameters, before any byte moves.

Everything wrong is collected and refused at once (`MetadataRejected` lists every offender
per kind) so that one round trip tells the operator the whole mismatch: a learner and an
engine built from different configs typically differ in many names at the same time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError, MetadataRejected
from pipeline.weights import tp
from pipeline.weights.plan import Chunk, chunks_of, parse_dtype
from pipeline.wire.messages import WeightEntry, WeightMeta

TRANSPORTS = frozenset({"gloo", "nccl", "cuda_ipc"})
KINDS = ("unknown", "missing", "duplicate", "shape", "dtype", "no_tp_rule", "layout", "transport")


@dataclass(frozen=True)
class ParamSpec:
    """One engine parameter as the engine holds it (its TP shard)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def params_of(module: torch.nn.Module) -> dict[str, ParamSpec]:
    return {n: ParamSpec(tuple(p.shape), p.dtype) for n, p in module.named_parameters()}


@dataclass(frozen=True)
class Layout:
    """A validated update: what to unpack from each bucket and into which full tensor."""

    version: int
    transport: str
    bucket_sizes: tuple[int, ...]
    # per bucket: its chunks in wire order
    by_bucket: tuple[tuple[Chunk, ...], ...]
    # name -> (shape, dtype) as it arrives: full, or this rank's shard when resharded
    full: dict[str, tuple[tuple[int, ...], torch.dtype]]
    resharded: bool = False  # the entries are this engine's own shards: no slicing
    p2p: bool = False  # each bucket comes by a send to this engine alone

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)


def _check_chunks(name: str, rows: list[WeightEntry], sizes: list[int]) -> str | None:
    """Why this name's entries are not one tensor split over consecutive buckets, or None."""
    first = rows[0]
    dtype = parse_dtype(first.dtype)
    if any(r.dtype != first.dtype or r.shape != first.shape for r in rows):
        return f"{name}: chunks disagree on dtype/shape"
    if dtype is None:
        return None  # reported as a dtype problem
    expected = math.prod(first.shape) * dtype.itemsize
    total = sum(r.nbytes for r in rows)
    if total != expected:
        return (
            f"{name}: entries hold {total} bytes, {first.dtype}{list(first.shape)} needs {expected}"
        )
    for i, r in enumerate(rows):
        if r.offset % dtype.itemsize:
            return f"{name}: offset {r.offset} not aligned to {dtype.itemsize} bytes"
        if i > 0 and (r.bucket != rows[i - 1].bucket + 1 or r.offset != 0):
            return f"{name}: chunk {i} does not continue at offset 0 of the next bucket"
        if i < len(rows) - 1 and r.offset + r.nbytes != sizes[r.bucket]:
            return f"{name}: chunk {i} does not fill its bucket to the end"
    return None


def _check_buckets(meta: WeightMeta, problems: dict[str, list[str]]) -> None:
    sizes = meta.bucket_sizes
    if any(s < 0 for s in sizes):
        problems["layout"].append(f"negative bucket size in {sizes}")
        return
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for e in meta.entries:
        if not 0 <= e.bucket < len(sizes):
            problems["layout"].append(f"{e.name}: bucket {e.bucket} of {len(sizes)}")
        elif e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > sizes[e.bucket]:
            problems["layout"].append(
                f"{e.name}: bytes [{e.offset}, {e.offset + e.nbytes}) outside bucket "
                f"{e.bucket} of {sizes[e.bucket]} bytes"
            )
        else:
            spans.setdefault(e.bucket, []).append((e.offset, e.offset + e.nbytes, e.name))
    for bucket, items in spans.items():
        items.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(items):
            if start < end:
                problems["layout"].append(f"{a} and {b} overlap in bucket {bucket}")


def validate_meta(
    meta: WeightMeta,
    expected: Mapping[str, ParamSpec],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Layout:
    """Return the unpack layout, or raise MetadataRejected naming every offender by kind.
    Resharded metadata (`meta.tp_size > 1`) must carry this engine's own TP rank and size,
    and every entry this rank's shard shape."""
    problems: dict[str, list[str]] = {k: [] for k in KINDS}
    if meta.transport not in TRANSPORTS:
        problems["transport"].append(meta.transport)
    resharded = meta.tp_size > 1
    if resharded and (meta.tp_rank, meta.tp_size) != (tp_rank, tp_size):
        problems["layout"].append(
            f"shards of TP rank {meta.tp_rank} of {meta.tp_size}; this engine is rank "
            f"{tp_rank} of {tp_size}"
        )
    _check_buckets(meta, problems)
    rows: dict[str, list[WeightEntry]] = {}
    positions: dict[str, list[int]] = {}
    for i, e in enumerate(meta.entries):
        rows.setdefault(e.name, []).append(e)
        positions.setdefault(e.name, []).append(i)
    full: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, entries in rows.items():
        pos = positions[name]
        if pos != list(range(pos[0], pos[0] + len(pos))):
            problems["duplicate"].append(name)
            continue
        if len(entries) > 1 and all(
            (dt := parse_dtype(e.dtype)) is not None
            and e.nbytes == math.prod(e.shape) * dt.itemsize
            for e in entries
        ):
            problems["duplicate"].append(name)
            continue
        if name not in expected:
            problems["unknown"].append(name)
            continue
        if not any(e.bucket >= len(meta.bucket_sizes) for e in entries):
            why = _check_chunks(name, entries, list(meta.bucket_sizes))
            if why:
                problems["layout"].append(why)
        spec = expected[name]
        dtype = parse_dtype(entries[0].dtype)
        if dtype is None:
            problems["dtype"].append(f"{name}: unknown dtype {entries[0].dtype!r}")
        elif dtype != spec.dtype:
            problems["dtype"].append(f"{name}: {entries[0].dtype} != engine {spec.dtype}")
        try:
            want = spec.shape if resharded else tp.full_shape(name, spec.shape, tp_size)
        except ConfigError as exc:
            problems["no_tp_rule"].append(f"{name}: {exc}")
            continue
        if tuple(entries[0].shape) != want:
            what = "shard" if resharded else "full"
            problems["shape"].append(
                f"{name}: {list(entries[0].shape)} != engine {what} {list(want)}"
            )
        elif dtype is not None:
            full[name] = (want, dtype)
    problems["missing"].extend(sorted(set(expected) - set(rows)))
    if any(problems.values()):
        raise MetadataRejected({k: v for k, v in problems.items() if v})
    by_bucket: list[list[Chunk]] = [[] for _ in meta.bucket_sizes]
    for chunk in chunks_of(meta.entries):
        by_bucket[chunk.bucket].append(chunk)
    return Layout(
        version=meta.version,
        transport=meta.transport,
        bucket_sizes=tuple(meta.bucket_sizes),
        by_bucket=tuple(tuple(b) for b in by_bucket),
        full=full,
        resharded=resharded,
        p2p=meta.p2p,
    )
