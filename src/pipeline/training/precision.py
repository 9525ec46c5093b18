"""Low-precision compute over float32 master weights, for a single (unsharded) process.

FSDP2 casts parameters to the compute dtype by itself. A single process used to rely on
autocast instead, which leaves the embeddings' output in float32, so every elementwise op
of the trunk (RoPE, norms, residuals) ran in float32 and attention fell back from flash
varlen to a dense masked kernel. `ComputeWeights` gives a single process what FSDP gives a
sharded one:

  * inside `with compute_weights():` every parameter's `.data` is a bfloat16 (or float16)
    copy of its float32 master, refreshed on entry by one foreach copy, so the whole
    forward and backward run in the compute dtype. (`.data`, not the parameter objects in
    the modules' dicts, although the `.data` stores cost host time: a dict store every step
    defeats dynamo's dict-tag fast path for the compiled trunk's guards, whose check then
    became several times slower, and the learner bench's step got slower);
  * a backward leaves low-precision gradients in `.grad`; `flush()` (called after each
    micro-batch's backward, and on exit) adds them into float32 accumulators with one
    foreach op, so micro-batches add up in float32. One foreach call per micro-batch
    replaces a Python hook per parameter per backward (about 300 on a 0.5B model, each
    an allocation and a kernel launch: the backward was bound by the host);
  * on exit the masters are back in `.data` with the float32 gradients in `.grad`:
    clipping, the optimizer, checkpoints, exports and weight sync see float32 as before.

With `flat=True` (the engine's choice for the fused optimizer in one process) the masters,
the float32 accumulators and the compute copies are views of one flat buffer each, so
`FlatAdamW` (flat_adamw.py) updates every parameter with one kernel, which also writes the
bf16 compute copies (`mark_fresh`: the next entry then copies nothing). Otherwise
`prepare()` queues the refresh of the compute copies ahead of the entry, while the host
still plans the step.

The float32 accumulators are allocated once and reused by every later step (a fresh set per
step cost ~300 allocations on the host, between backward and optimizer, while the device
idled): a `.grad` kept across `optimizer.zero_grad` is overwritten by the next step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from pipeline.models.layers import adjacent_order
from pipeline.training.flat_adamw import FlatLayout

# (tensors, data pointers, indices) -> all equal, in one C++ pass; CUDA builds of torch have
# it (CUDA-graph trees check their static inputs with it)
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def data_ptrs_equal(tensors: Sequence[Tensor], ptrs: list[int]) -> bool:
    """Whether every tensor's data pointer is the one given (~290 Python calls on a 0.5B
    model where torch lacks the C++ check)."""
    if _PTRS_EQUAL is not None:
        return bool(_PTRS_EQUAL(tensors, ptrs, _all_indices(len(tensors))))
    return all(t.data_ptr() == p for t, p in zip(tensors, ptrs, strict=True))


@functools.cache
def _all_indices(n: int) -> list[int]:
    """0..n-1 for the C++ check, built once per length (it runs each step; it only reads)."""
    return list(range(n))


class ComputeWeights:
    """Swaps low-precision compute copies in and out of a module's parameters."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, *, flat: bool = False) -> None:
        """`flat`: masters, float32 gradient accumulators and compute copies as views of one
        flat buffer each (`layout`), for `FlatAdamW` to update in one kernel."""
        self.dtype = dtype
        # shared ones once; gate|up and q|k|v weights back to back (one GEMM operand each)
        self.params: list[nn.Parameter] = adjacent_order(model)
        self._grads: list[Tensor | None] = [None] * len(self.params)  # float32 accumulators
        self.layout: FlatLayout | None = None
        self.flat_masters: Tensor | None = None
        self.flat_grads: Tensor | None = None
        if flat and self.params:
            layout = self.layout = FlatLayout.of(self.params)
            first = self.params[0]
            masters = self.flat_masters = layout.buffer(first, torch.float32)
            self.flat_grads = layout.buffer(first, torch.float32)
            with torch.no_grad():
                for p, view in zip(self.params, layout.views(masters), strict=True):
                    view.copy_(p.data)
                    p.data = view
            self._flat_low: Tensor | None = layout.buffer(first, dtype)
            self._low = layout.views(self._flat_low)
            # their reused storage
            self._buffers: list[Tensor | None] = list(layout.views(self.flat_grads))
            self._master_views: list[Tensor] | None = layout.views(masters)
            self._master_ptrs = [v.data_ptr() for v in self._master_views]
        else:
            self._flat_low = None
            self._low = [torch.empty_like(p, dtype=dtype) for p in self.params]
            self._buffers = [None] * len(self.params)
            self._master_views = None
            self._master_ptrs = []
        self.active = False
        # the compute copies equal the masters (the flat optimizer wrote both): no refresh
        self._fresh = False
        # set by `prepare`: the copies were refreshed from these masters for the next entry
        self._prepared: list[Tensor] | None = None
        self._defer = False  # this entry may leave its only backward's gradients pending
        self._pending: list[Tensor] | None = None

    @torch.no_grad()
    def flush(self) -> None:
        """Move the low-precision gradients of the last backward(s) into the float32
        accumulators: one foreach copy for parameters seen for the first time, one foreach
        add for the rest. Under `defer`, the first backward's gradients instead stay as they
        are, pending (see `pending_grads`), until a second backward or `materialize`."""
        if not self.active or all(p.grad is None for p in self.params):
            return  # nothing since the last flush (pending gradients stay pending)
        self.materialize()
        if self._defer and self._stash():
            return
        new_i, new_src, add_dst, add_src = [], [], [], []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            acc = self._grads[i]
            if acc is None:
                new_i.append(i)
                new_src.append(g)
            else:
                add_dst.append(acc)
                add_src.append(g)
            p.grad = None
        if new_src:
            fresh = [self._buffer(i) for i in new_i]
            torch._foreach_copy_(fresh, new_src)
            for i, t in zip(new_i, fresh, strict=True):
                self._grads[i] = t
        if add_src:
            torch._foreach_add_(add_dst, add_src)

    def _stash(self) -> bool:
        """Keep the gradients of a first backward that covered every parameter pending."""
        grads = [p.grad for p in self.params]
        fresh = all(acc is None for acc in self._grads)
        if (
            not fresh
            or self.layout is None
            or any(g is None or g.dtype != self.dtype or not g.is_contiguous() for g in grads)
        ):
            return False
        self._pending = grads  # type: ignore[assignment]
        for p in self.params:
            p.grad = None
        return True

    def pending_grads(self) -> list[Tensor] | None:
        """The low-precision gradients of the only backward of the last `defer` entry, in
        parameter order, not yet in the float32 accumulators (whose `.grad` views hold stale
        values until `materialize`); None when there are none. An optimizer that reads them
        (FlatAdamW) saves the float32 copy and its read. It must `drop_pending` after
        queueing its update. They may be outputs of a
        CUDA graph, which its next replay overwrites: `materialize` before another forward
        (`TrainEngine.begin_forward` does)."""
        return self._pending

    def drop_pending(self) -> None:
        self._pending = None

    @torch.no_grad()
    def materialize(self) -> None:
        """Copy pending gradients into the float32 accumulators (what `flush` would have
        done): the `.grad` of every parameter is then current."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        torch._foreach_copy_([self._buffer(i) for i in range(len(self.params))], pending)
        if self.active:  # a second backward follows: the copies are the accumulators
            for i in range(len(self.params)):
                self._grads[i] = self._buffer(i)

    def _buffer(self, i: int) -> Tensor:
        buf = self._buffers[i]
        if buf is None:
            buf = self._buffers[i] = torch.empty_like(self.params[i], dtype=torch.float32)
        return buf

    @property
    def flat_low(self) -> Tensor | None:
        """The compute copies' flat buffer (flat layout only), for an optimizer that writes
        them with the masters (then `mark_fresh`)."""
        return self._flat_low

    def mark_fresh(self) -> None:
        """The flat compute copies are written with the flat masters (by the optimizer's
        kernel, in stream order): the next entry skips its refresh while the masters stay
        the flat views."""
        self._fresh = True

    def invalidate(self) -> None:
        """The masters changed (or may have) without their copies: refresh at next entry.
        Whatever writes the masters in place other than the flat optimizer calls it (the
        engine: torch's optimizer, a checkpoint load)."""
        self._fresh = False

    def _masters(self) -> list[Tensor]:
        """The parameters' float32 masters, read each time (a checkpoint load may have
        replaced them) unless every one is still its view of the flat buffer (a load copies
        into them): reading ~290 `.data` attributes every step costs host time."""
        views = self._master_views
        if views is not None and data_ptrs_equal(self.params, self._master_ptrs):
            return views
        return [p.data for p in self.params]

    @torch.no_grad()
    def _refresh(self, masters: list[Tensor]) -> None:
        """Compute copies = masters: one copy of the flat buffer when the masters are its
        views (one launch instead of a foreach over ~290 tensors, whose host time the device
        would idle through at the start of a step)."""
        if masters is self._master_views and self._flat_low is not None:
            assert self.flat_masters is not None
            if not self._fresh:
                self._flat_low.copy_(self.flat_masters)  # gaps are zero in both
        else:
            torch._foreach_copy_(self._low, masters)

    def prepare(self) -> None:
        """Queue the refresh of the compute copies now, for the next entry to skip it: the
        device copies while the host still plans the step. The next entry (or `discard`)
        consumes it, so the masters must not change in between."""
        if not self.active:
            self._prepared = self._masters()
            self._refresh(self._prepared)

    def discard(self) -> None:
        """Forget an unconsumed `prepare` (the next entry copies again)."""
        self._prepared = None

    @contextlib.contextmanager
    def prepared(self) -> Iterator[None]:
        """`prepare` now, `discard` whatever the body left unconsumed on the way out."""
        self.prepare()
        try:
            yield
        finally:
            self.discard()

    @contextlib.contextmanager
    def __call__(self, *, defer: bool = False) -> Iterator[None]:
        """Compute in low precision inside; float32 masters and gradients outside. Nested
        uses share the outer one. `defer`: when one backward ran inside (and covered every
        parameter of the flat layout), its gradients stay pending for the optimizer instead
        of being copied to float32 (`pending_grads`); the caller must then consume them or
        `materialize` before reading `.grad`."""
        if self.active:
            yield
            return
        self.materialize()  # an unconsumed earlier deferral keeps adding up as before
        masters = self._prepared  # a prepared entry reuses its reading of the masters
        if masters is None:
            masters = self._masters()
            self._refresh(masters)
        self.discard()
        for i, (p, low) in enumerate(zip(self.params, self._low, strict=True)):
            grad = p.grad  # float32 gradients so far keep adding up
            if grad is not None:  # (none after zero_grad: the accumulator is None already)
                self._grads[i], p.grad = grad, None
            p.data = low
        self.active = True
        self._defer = defer
        try:
            yield
            self.flush()
        except BaseException:
            self._pending = None  # as unflushed gradients: dropped
            raise
        finally:
            self.active = False
            self._defer = False
            pending = self._pending is not None
            for i, (p, master) in enumerate(zip(self.params, masters, strict=True)):
                p.grad = None  # flushed gradients are in the accumulators; an exception
                p.data = master  # drops unflushed ones
                p.grad, self._grads[i] = self._buffer(i) if pending else self._grads[i], None
