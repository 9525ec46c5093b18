"""Mini-batches, token-budget micro-batches, padding-free packing, and accumulation weights.

Splitting is deterministic: mini-batches are contiguous slices (after an optional seeded
permutation), micro-batches come from first-fit-decreasing on sequence length with ties
broken by index. Under FSDP every rank must run the same number of forward/backward passes,
so the micro-batch count of each mini-batch is agreed across ranks (the maximum) and ranks
with fewer fill up by splitting their largest micro-batches, then with empty ones that run a
one-token dummy forward whose loss is multiplied by zero.

Gradient accumulation weights make the summed micro-batch losses equal the loss of the whole
global mini-batch: a micro-batch loss aggregated over its own tokens (or sequences) is
scaled by its share of the global mini-batch's tokens (sequences), times the world size
because FSDP averages gradients over ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.algorithms import LossAggMode
from pipeline.training.batch import ExperienceBatch
from pipeline.training.errors import BatchError
from pipeline.training.transfer import to_device

IntsReducer = Callable[[list[int], str], list[int]]


def _local_reduce(values: list[int], op: str) -> list[int]:
    return list(values)


@dataclass(frozen=True)
class MicroBatch:
    """The inputs of one forward pass and how to map its outputs back to (m, r) responses.

    Packed: input_ids/target_ids/position_ids (1, T) with cu_seqlens (m + 1,).
    Padded: (m, S) right-padded with attention_mask (m, S).
    gather_index (m, r) indexes input_ids.view(-1): the position whose output predicts (or
    values) each response token; r is the longest response in this micro-batch.
    score_index (n,) lists those positions once each (sample by sample, padding left out):
    the only positions whose log-probs a loss reads, so the output layer (a quarter of a
    small model's FLOPs with a 152k vocabulary) runs on them alone; score_gather (m, r)
    indexes that (n,) vector like gather_index indexes the positions.
    """

    sample_indices: Tensor  # (m,) rows of the ExperienceBatch
    input_ids: Tensor
    target_ids: Tensor
    position_ids: Tensor
    gather_index: Tensor  # (m, r)
    score_index: Tensor  # (n,) response-predicting positions
    score_gather: Tensor  # (m, r) into score_index's outputs
    cu_seqlens: Tensor | None = None  # (m + 1,) int64, packed only
    attention_mask: Tensor | None = None  # (m, S), padded only
    num_tokens: int = 0  # real (prompt + response) tokens
    max_seqlen: int = 0  # packed: the longest sequence, known on the host (no device read)
    uniform: bool = False  # packed: every sequence is max_seqlen long, no padding sequence
    # packed: the one int64 tensor every input and layout field above is a view of, laid
    # out by the packer, so that `to` moves them all with one copy
    buffer: Tensor | None = None

    @property
    def is_empty(self) -> bool:
        """A dummy that only keeps FSDP collectives in step with the other ranks."""
        return self.sample_indices.numel() == 0

    @property
    def width(self) -> int:
        return self.gather_index.shape[1]

    def fields(self, t: Tensor) -> Tensor:
        """A batch's (n, R) field restricted to this micro-batch: (m, r). A host field is
        indexed by NumPy: torch's CPU index op runs on the intra-op thread pool even for a
        few kilobytes, and in a profiled GPU step each one held the host for milliseconds
        while the device idled."""
        if t.device.type == "cpu" and not t.requires_grad and t.dtype in _NUMPY_DTYPES:
            return torch.from_numpy(t.numpy()[self.sample_indices.numpy(), : self.width])
        return t[self.sample_indices.to(t.device), : self.width]

    def put(self, out: Tensor, values: Tensor) -> None:
        """`out[rows, :width] = values` for a host (n, R) `out`, by NumPy (see `fields`)."""
        out.numpy()[self.sample_indices.numpy(), : self.width] = values.numpy()

    def fields_to(self, device: torch.device, named: dict[str, Tensor | None]) -> dict[str, Tensor]:
        """Several (n, R) host fields restricted to this micro-batch, (m, r) each, on `device`
        (absent ones left out), in one copy per dtype (`to_device_grouped`): a few host ops
        instead of one indexing op per field, which on a busy GPU host took milliseconds
        each. The trainer calls it right after queueing the micro-batch's forward (tens of
        milliseconds of device work on a GPU), so that the host does it while the device
        computes instead of while the device waits for the step's first kernel."""
        host = {k: self.fields(t) for k, t in named.items() if t is not None}
        return to_device_grouped(host, device)

    def gather(self, per_position: Tensor) -> Tensor:
        """Per-position model output shaped like input_ids -> (m, r) response layout."""
        return _take(per_position.reshape(-1), self.gather_index)

    def gather_scored(self, scored: Tensor) -> Tensor:
        """Outputs at score_index (n,) -> (m, r) response layout (padding reads entry 0)."""
        return _take(scored, self.score_gather)

    def device_fields(self) -> dict[str, Tensor]:
        """The model inputs and output layout that go to the device, by name (absent ones
        left out), in _DEVICE_FIELDS order."""
        return {k: t for k in _DEVICE_FIELDS if (t := getattr(self, k)) is not None}

    def to(self, device: torch.device) -> MicroBatch:
        """The model inputs and output layout on `device` (sample_indices stay on the host):
        the packer's `buffer` in one copy, the fields as the same views of the copy (this
        runs while the device waits for the step's first kernel, so the host time saved is
        device time), else one copy per dtype."""
        named = self.device_fields()
        buffer = self.buffer
        if buffer is None or buffer.device == device or not _views_of(buffer, named):
            moved: dict[str, Any] = to_device_grouped(named, device)
            return dataclasses.replace(self, **moved, buffer=None)
        return self.on_copy(to_device(buffer, device), named)

    def on_copy(self, copy: Tensor, named: dict[str, Tensor] | None = None) -> MicroBatch:
        """This micro-batch with `copy` (of `buffer`) as its buffer and its fields (`named`,
        default all) as the same views of it."""
        assert self.buffer is not None, "on_copy needs a packer's buffer"
        if named is None:
            named = self.device_fields()
        base = self.buffer.storage_offset()
        views: dict[str, Any] = {
            k: copy.as_strided(t.shape, t.stride(), t.storage_offset() - base)
            for k, t in named.items()
        }
        return dataclasses.replace(self, **views, buffer=copy)


def _views_of(buffer: Tensor, named: dict[str, Tensor]) -> bool:
    """Every tensor lies in `buffer`'s storage (a field replaced since packing would not)."""
    ptr = buffer.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == ptr for t in named.values())


def _one_buffer(arrays: dict[str, np.ndarray]) -> tuple[Tensor, dict[str, Tensor]]:
    """int64 `arrays` (device fields by name) as views of one flat tensor, in _DEVICE_FIELDS
    order, each at a 16-byte boundary (`to_device_grouped`'s layout), filled by NumPy slice
    stores: a few microseconds each where the torch ops of a regrouping cost tens."""
    ordered = [(k, arrays[k]) for k in _DEVICE_FIELDS if k in arrays]
    if len(ordered) != len(arrays):
        raise ValueError(f"not device fields: {sorted(set(arrays) - set(_DEVICE_FIELDS))}")
    sizes = [_aligned(a.size, np.dtype(np.int64).itemsize) for _, a in ordered]
    flat = np.zeros(sum(sizes), dtype=np.int64)
    buffer = torch.from_numpy(flat)
    views, offset = {}, 0
    for (key, array), size in zip(ordered, sizes, strict=True):
        flat[offset : offset + array.size] = array.reshape(-1)
        views[key] = buffer[offset : offset + array.size].view(array.shape)
        offset += size
    return buffer, views


# dtypes whose host tensors NumPy indexes (MicroBatch.fields)
_NUMPY_DTYPES = (torch.bool, torch.float32, torch.float64, torch.int32, torch.int64)

# the compiled trunk's inputs first: their offsets in the shared buffer then depend on the
# bucketed shapes alone, not on the response lengths behind the output layout's sizes, so a
# compiled trunk sees the same input layout whenever it sees the same shapes
_DEVICE_FIELDS = (
    "input_ids",
    "position_ids",
    "cu_seqlens",
    "attention_mask",
    "target_ids",
    "gather_index",
    "score_index",
    "score_gather",
)


def to_device_grouped(named: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """`named` on `device`, each a view of one buffer per dtype filled by one non-blocking
    copy (parts 16-byte aligned): queueing a copy costs the host tens of microseconds, and
    a micro-batch has about ten small tensors, all needed before its forward starts."""
    if all(t.device == device for t in named.values()):
        return dict(named)
    return packed_copies(named, lambda buffer: to_device(buffer, device))


def _aligned(numel: int, itemsize: int) -> int:
    """`numel` rounded up so that the next part of a shared buffer starts 16 bytes on."""
    align = max(1, 16 // itemsize)
    return numel + -numel % align


def packed_copies(named: dict[str, Tensor], copy: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """`named` as views of `copy(buffer)`, one flat buffer per dtype (see to_device_grouped)."""
    out: dict[str, Tensor] = {}
    for dtype in dict.fromkeys(t.dtype for t in named.values()):
        keys = [k for k, t in named.items() if t.dtype == dtype]
        parts, spans = [], []
        for k in keys:
            flat = named[k].reshape(-1)
            span = _aligned(flat.numel(), dtype.itemsize)
            parts += [flat, flat.new_zeros(span - flat.numel())] if span > flat.numel() else [flat]
            spans.append(span)
        buffer = copy(torch.cat(parts))
        for k, piece in zip(keys, buffer.split(spans), strict=True):
            out[k] = piece[: named[k].numel()].view(named[k].shape)
    return out


def _sequences(batch: ExperienceBatch, indices: Sequence[int]) -> list[Tensor]:
    return [torch.cat([batch.prompt_ids[i], batch.response_ids[i]]) for i in indices]


def _response_layout(
    batch: ExperienceBatch, indices: Sequence[int], starts: Sequence[int]
) -> dict[str, np.ndarray]:
    """gather_index (m, r): flat positions predicting each response token, padding at 0
    (masked); score_index (n,): the valid ones in order; score_gather (m, r): where each
    response token's output sits in score_index's (n,) outputs, padding at 0.

    Built in NumPy from the host lengths: on a busy GPU host a torch boolean index here
    took milliseconds while the device sat idle at the start of a step.
    """
    lengths = np.array([batch.response_ids[i].numel() for i in indices], dtype=np.int64)
    prompt_lens = np.array([batch.prompt_ids[i].numel() for i in indices], dtype=np.int64)
    width = int(lengths.max()) if len(indices) else 0
    j = np.arange(width, dtype=np.int64)[None, :]  # (1, r)
    valid = j < lengths[:, None]  # (m, r)
    base = np.asarray(starts, dtype=np.int64).reshape(-1) + prompt_lens - 1  # (m,)
    index = base[:, None] + j  # (m, r)
    row_starts = np.cumsum(lengths) - lengths  # (m,) first entry of each sample's block
    scored = index[valid]  # row-major: sample by sample
    if not scored.size and len(indices):
        # only empty responses (episodes whose environment failed at reset): one prompt
        # position is scored, read by nothing, so the loss keeps a backward path like a
        # dummy's (without it the learner died: "does not require grad")
        scored = base[:1]
    return {
        "gather_index": np.where(valid, index, 0),
        "score_index": scored,
        "score_gather": np.where(valid, row_starts[:, None] + j, 0),
    }


def _dummy() -> MicroBatch:
    one = torch.zeros(1, 1, dtype=torch.long)
    return MicroBatch(
        sample_indices=torch.zeros(0, dtype=torch.long),
        input_ids=one,
        target_ids=one,
        position_ids=one,
        gather_index=torch.zeros(0, 0, dtype=torch.long),
        score_index=torch.zeros(1, dtype=torch.long),  # one position: a backward path for
        score_gather=torch.zeros(0, 0, dtype=torch.long),  # the anchor
        cu_seqlens=torch.tensor([0, 1]),
        max_seqlen=1,
    )


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def pack_padding_free(
    batch: ExperienceBatch, indices: Sequence[int], bucket: int = 0
) -> MicroBatch:
    """Concatenate the samples into one (1, T) row with cu_seqlens and per-sequence positions.

    No padding is computed: attention is block-diagonal causal. Each sequence's last target
    is a placeholder (0) since nothing after it is scored.

    `bucket` > 0 makes the shapes few, for CUDA graphs (compile_mode reduce-overhead records
    one per distinct shape): T is padded to a multiple of `bucket` by one padding sequence
    of its own (never gathered), cu_seqlens to a power-of-two count of sequences by empty
    ones, and max_seqlen is rounded up to a power of two (an upper bound is all attention
    needs). Sequences that all have one length and fill whole buckets are `uniform`: n
    sequences of exactly max_seqlen (cu_seqlens not padded either), which the model may
    attend as an (n, max_seqlen) batch.
    """
    if not indices:
        return _dummy()
    # one torch op for all sequences, then NumPy: this runs while the device waits (a
    # `.numpy()` per sequence was four dispatched ops each, 128 for 16 samples)
    parts = [t for i in indices for t in (batch.prompt_ids[i], batch.response_ids[i])]
    lengths = [a.numel() + b.numel() for a, b in zip(parts[0::2], parts[1::2], strict=True)]
    offsets = [0, *np.cumsum(lengths).tolist()]
    total = offsets[-1]
    ids = torch.cat(parts).numpy().astype(np.int64, copy=False)  # (T,)
    targets = np.zeros_like(ids)  # (T,): the next token; each sequence's last stays 0
    targets[:-1] = ids[1:]
    targets[np.asarray(offsets[1:]) - 1] = 0
    positions = np.arange(total) - np.repeat(offsets[:-1], lengths)  # (T,)
    longest = max(lengths)
    # one length and nothing to pad: the row is (n, longest) as it stands
    uniform = min(lengths) == longest and (bucket <= 0 or total % bucket == 0)
    if bucket > 0 and not uniform:
        pad = -total % bucket
        if pad:
            ids = np.concatenate([ids, np.zeros(pad, dtype=np.int64)])
            targets = np.concatenate([targets, np.zeros(pad, dtype=np.int64)])
            positions = np.concatenate([positions, np.arange(pad)])
            offsets.append(total + pad)
        sequences = _pow2(len(offsets) - 1, 8)
        offsets.extend([offsets[-1]] * (sequences + 1 - len(offsets)))
        longest = _pow2(max(longest, pad), 128)
    # one buffer for one copy to the device
    buffer, fields = _one_buffer(
        {
            "input_ids": ids[None],
            "position_ids": positions[None],
            "cu_seqlens": np.asarray(offsets, dtype=np.int64),
            "target_ids": targets[None],
            **_response_layout(batch, indices, offsets[: len(lengths)]),
        }
    )
    return MicroBatch(
        sample_indices=torch.as_tensor(list(indices), dtype=torch.long),
        **fields,
        num_tokens=total,
        max_seqlen=longest,
        uniform=uniform,
        buffer=buffer,
    )


def pack_padded(batch: ExperienceBatch, indices: Sequence[int]) -> MicroBatch:
    """Right-padded (m, S) fallback for attention kernels without packing support."""
    if not indices:
        return _dummy()
    seqs = _sequences(batch, indices)
    lengths = torch.tensor([s.numel() for s in seqs])
    width = int(lengths.max())
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()] = s
        targets[row, : s.numel() - 1] = s[1:]
    attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # (m, S)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (m, S)
    starts = [row * width for row in range(len(seqs))]
    layout: dict[str, Any] = {
        k: torch.from_numpy(a) for k, a in _response_layout(batch, indices, starts).items()
    }
    return MicroBatch(
        sample_indices=torch.as_tensor(list(indices), dtype=torch.long),
        input_ids=ids,
        target_ids=targets,
        position_ids=positions,
        **layout,
        attention_mask=attention_mask,
        num_tokens=int(lengths.sum()),
    )


def split_mini_batches(order: Sequence[int], num_mini_batches: int) -> list[list[int]]:
    """Contiguous, near-equal slices of `order` (sizes differ by at most one, larger first)."""
    n = len(order)
    base, extra = divmod(n, num_mini_batches)
    out, start = [], 0
    for m in range(num_mini_batches):
        size = base + (1 if m < extra else 0)
        out.append(list(order[start : start + size]))
        start += size
    return out


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_count: int = 0
) -> list[list[int]]:
    """Positions of `lengths` grouped into micro-batches of at most `max_tokens` tokens.

    First-fit-decreasing (longest first, ties by position) keeps the count near minimal; a
    sequence longer than the budget gets a micro-batch of its own. With `min_count` the
    largest multi-sequence micro-batches are halved, then empty ones appended, until there
    are that many. Each micro-batch lists its positions in increasing order.
    """
    if max_tokens < 1:
        raise BatchError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    while len(bins) < min_count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda k: (loads[k], -k))
        items = bins[b]  # longest first: alternate to balance the halves
        first, second = items[0::2], items[1::2]
        bins[b], loads[b] = first, sum(lengths[i] for i in first)
        bins.append(second)
        loads.append(sum(lengths[i] for i in second))
    bins.extend([] for _ in range(min_count - len(bins)))
    return [sorted(b) for b in bins]


def sample_units(mask: Tensor, loss_agg_mode: LossAggMode) -> list[int]:
    """What each sample adds to what the loss averages over, as host ints: its valid tokens
    (token-mean) or 1 if it has any (sequence modes). Subsets are summed in Python rather
    than by indexing the mask once per mini- and micro-batch."""
    if loss_agg_mode == "token-mean":
        return mask.sum(dim=-1).tolist()
    return mask.bool().any(dim=-1).long().tolist()


def micro_batch_weight(local_units: int, global_units: int, world_size: int) -> float:
    """Scale of a micro-batch's own-mean loss so the sum over micro-batches and ranks (with
    FSDP's gradient averaging) is the mean over the whole global mini-batch."""
    if global_units <= 0:
        return 0.0
    return local_units / global_units * world_size


@dataclass(frozen=True)
class MiniBatchPlan:
    """One optimizer step's micro-batches and their accumulation weights."""

    micro_batches: list[MicroBatch]
    weights: list[float]  # per micro-batch
    shares: list[float]  # per micro-batch: its share of the global mini-batch (weights / W)
    global_units: int

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)


def pack(
    batch: ExperienceBatch, indices: Sequence[int], padding_free: bool, bucket: int = 0
) -> MicroBatch:
    if padding_free:
        return pack_padding_free(batch, indices, bucket)
    return pack_padded(batch, indices)


def plan_forward(
    batch: ExperienceBatch,
    max_tokens: int,
    *,
    padding_free: bool = True,
    reduce: IntsReducer = _local_reduce,
    bucket: int = 0,
) -> list[MicroBatch]:
    """Micro-batches covering the whole batch for a no-grad forward (same count on all ranks)."""
    lengths = batch.seq_lengths
    bins = plan_micro_batches(lengths, max_tokens)
    count = reduce([len(bins)], "max")[0]
    bins = plan_micro_batches(lengths, max_tokens, min_count=count)
    return [pack(batch, b, padding_free, bucket) for b in bins]


def plan_step(
    batch: ExperienceBatch,
    *,
    num_mini_batches: int,
    max_tokens: int,
    loss_agg_mode: LossAggMode,
    order: Sequence[int] | None = None,
    padding_free: bool = True,
    world_size: int = 1,
    reduce: IntsReducer = _local_reduce,
    bucket: int = 0,
) -> list[MiniBatchPlan]:
    """Mini-batches (contiguous in `order`) of weighted micro-batches, agreed across ranks.

    Two small collectives per call: the micro-batch counts (max) and the loss units of each
    global mini-batch (sum), both as one vector.
    """
    order = list(range(batch.num_samples)) if order is None else list(order)
    minis = split_mini_batches(order, num_mini_batches)
    lengths = batch.seq_lengths
    local_bins = [plan_micro_batches([lengths[i] for i in mini], max_tokens) for mini in minis]
    counts = reduce([len(b) for b in local_bins], "max")
    per_sample = sample_units(batch.response_mask, loss_agg_mode)
    units = [sum(per_sample[i] for i in mini) for mini in minis]
    global_units = reduce(units, "sum")
    plans = []
    for mini, count, total in zip(minis, counts, global_units, strict=True):
        bins = plan_micro_batches([lengths[i] for i in mini], max_tokens, min_count=count)
        micro, weights, shares = [], [], []
        for b in bins:
            indices = [mini[p] for p in b]
            local = sum(per_sample[i] for i in indices)
            micro.append(pack(batch, indices, padding_free, bucket))
            weights.append(micro_batch_weight(local, total, world_size))
            shares.append(micro_batch_weight(local, total, 1))
        plans.append(MiniBatchPlan(micro, weights, shares, total))
    return plans


def _take(flat: Tensor, index: Tensor) -> Tensor:
    """flat[index] for a 1-d `flat` by index_select: its backward is one index_add (where
    padding repeats an index it adds that entry's zero gradients), where advanced
    indexing's sorts the indices first (~9 kernels on a GPU)."""
    return flat.index_select(0, index.to(flat.device).reshape(-1)).view(index.shape)
