"""AdamW over flat buffers: one kernel for every parameter of a single process.

torch's fused AdamW walks the ~290 tensors of a 0.5B model in many launches of a few hundred
blocks each, short of the memory bandwidth. Here the float32 masters,
their gradient accumulators (both set up flat by `ComputeWeights(flat=True)`) and Adam's two
moments are views of four flat buffers, and one Triton kernel streams them once: 28 bytes
per parameter (24 with the first moment in bfloat16: `trainer.exp_avg_dtype`, computed in
float32 and stored rounded to nearest). Parameters, gradients and optimizer state keep
their per-parameter shapes and names, so checkpoints, exports and weight sync see nothing
different.

When an update has a single micro-batch, its bf16 gradients are not copied into the
float32 accumulators at all (`ComputeWeights(defer=True)` leaves them pending): `GradTable`
points a norm kernel and the update kernel at them in place, through a static table of
(parameter, first element) per block and each step's gradient offsets from one base
address: reading them in place is faster than the float32 copy, its norm and the flat
update (docs/performance.md).

The Triton kernels also write each updated master's compute copy (bf16) next to it, which
saves `ComputeWeights` the refresh copy of every master at the next step's start (1 GB
read + 1 GB written less per step on the 0.5B model).

The update is torch's AdamW (decoupled weight decay, bias corrections from a per-parameter
step count) with the same device-side clip factor and non-finite skip as
`optim.guarded_step`. Where a precondition fails (a parameter without a gradient, state
replaced by a checkpoint load that could not be re-bound, more than one param group) the
caller falls back to the torch optimizer for that step. Without Triton (CPU) the same flat
buffers go through `torch._fused_adamw_`, which is what the CPU tests exercise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

from pipeline.training.optim import clip_scale_and_skip

if TYPE_CHECKING:  # precision.py imports FlatLayout from here
    from pipeline.training.precision import ComputeWeights

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

ALIGN = 64  # elements: every view starts 256 B (float32) / 128 B (bfloat16) aligned
# elements per program of the AdamW kernels (8 warps): the fastest measured
# (docs/performance.md)
BLOCK = 1024
# table blocks per program of the norm kernel: fewer, longer programs read the gradients
# fastest (measured: docs/performance.md)
NORM_GROUP = 32
_VECTOR = 8  # 16-byte vectors of 2-byte gradients


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer (offsets aligned; gaps stay zero)."""

    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    total: int

    @classmethod
    def of(cls, params: list[nn.Parameter]) -> FlatLayout:
        offsets, at = [], 0
        for p in params:
            offsets.append(at)
            at += -(-p.numel() // ALIGN) * ALIGN
        return cls(tuple(offsets), tuple(p.shape for p in params), at)

    def buffer(self, like: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.zeros(self.total, dtype=dtype, device=like.device)

    def views(self, flat: Tensor) -> list[Tensor]:
        return [
            flat[o : o + shape.numel()].view(shape)
            for o, shape in zip(self.offsets, self.shapes, strict=True)
        ]

    def holds(self, flat: Tensor, tensors: list[Tensor | None]) -> bool:
        """Whether every tensor is still the view of `flat` this layout gave out."""
        base, size = flat.data_ptr(), flat.element_size()
        return all(
            t is not None and t.dtype == flat.dtype and t.data_ptr() == base + o * size
            for t, o in zip(tensors, self.offsets, strict=True)
        )


class Hyper(NamedTuple):
    """One AdamW param group's hyperparameters as the kernels take them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: dict[str, Any]) -> Hyper:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        return cls(float(lr), float(beta1), float(beta2), float(eps), float(decay))


def _update_args(
    flat: FlatAdamW, found_inf: Tensor, scale: Tensor | None, hyper: Hyper
) -> tuple[Any, ...]:
    """The arguments every AdamW kernel ends with: step count, skip flag, clip divisor
    (the skip flag stands in, unread, without clipping) and the hyperparameters."""
    return (flat._steps[0], found_inf, scale if scale is not None else found_inf, *hyper)


class FlatAdamW:
    """Steps a torch AdamW's parameters through flat buffers (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.AdamW,
        weights: ComputeWeights,
        *,
        exp_avg_dtype: torch.dtype = torch.float32,
    ) -> None:
        """`weights` must have been built with flat=True (it holds the masters and the
        gradient accumulators); the moments' buffers are this object's, the first one in
        `exp_avg_dtype` (float32 or bfloat16)."""
        if weights.layout is None or weights.flat_masters is None or weights.flat_grads is None:
            raise ValueError("FlatAdamW needs ComputeWeights(..., flat=True)")
        self.optimizer = optimizer
        self.weights = weights
        self.params = weights.params
        self.layout = weights.layout
        self.masters, self.grads = weights.flat_masters, weights.flat_grads
        if exp_avg_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"FlatAdamW: exp_avg_dtype float32 or bfloat16, not {exp_avg_dtype}")
        self.exp_avg = self.layout.buffer(self.masters, exp_avg_dtype)
        self.exp_avg_sq = self.layout.buffer(self.masters, torch.float32)
        self._steps: list[Tensor] = []
        self.disabled = False
        self._table: GradTable | None = None  # built on the first step from pending grads
        self.bind_state()

    def bind_state(self) -> None:
        """Move Adam's moments into the flat buffers (after construction, or a load that
        replaced the state tensors), keeping their values. The kernel reads one step count
        for all parameters, so unequal counts (read here, on the host: this is rare) turn
        the flat path off."""
        state = self.optimizer.state
        for name, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for p, view in zip(self.params, self.layout.views(flat), strict=True):
                current = state[p][name]
                if current.data_ptr() != view.data_ptr():
                    view.copy_(current)
                    state[p][name] = view
        self._steps = [state[p]["step"] for p in self.params]
        if len({float(s) for s in self._steps}) > 1:
            self.disabled = True

    def ready(self) -> bool:
        """Whether this step can run flat: one plain AdamW group, masters and gradients in
        place, state bound (re-bound if a load replaced it), step counts on the device.
        Once not (e.g. a parameter without a gradient, whose count the torch step then
        leaves behind), the flat path stays off, and a bfloat16 first moment becomes
        float32 state again (torch's AdamW steps it with the float32 masters)."""
        if not self.disabled:
            self.disabled = not self._check()
            if self.disabled and self.exp_avg.dtype != torch.float32:
                state = self.optimizer.state
                for p in self.params:
                    if "exp_avg" in state.get(p, {}):
                        state[p]["exp_avg"] = state[p]["exp_avg"].float()
        return not self.disabled

    def _check(self) -> bool:
        groups = self.optimizer.param_groups
        if len(groups) != 1 or groups[0]["amsgrad"] or groups[0]["maximize"]:
            return False
        state = self.optimizer.state
        if any("exp_avg" not in state.get(p, {}) for p in self.params):
            return False
        if not self.layout.holds(self.masters, [p.data for p in self.params]):
            return False
        if not self.layout.holds(self.grads, [p.grad for p in self.params]):
            return False
        steps = [state[p]["step"] for p in self.params]
        moments = [state[p]["exp_avg"] for p in self.params]
        squares = [state[p]["exp_avg_sq"] for p in self.params]
        bound = self.layout.holds(self.exp_avg, moments)
        if not bound or not self.layout.holds(self.exp_avg_sq, squares):
            self.bind_state()
        elif any(s is not t for s, t in zip(steps, self._steps, strict=True)):
            self.bind_state()  # step tensors replaced: check they agree
        on_device = all(s.device == self.masters.device and s.numel() == 1 for s in self._steps)
        return on_device and not self.disabled

    @torch.no_grad()
    def guarded_step(self, max_norm: float | None, bad: Tensor) -> tuple[Tensor, Tensor]:
        """Clip and update with no host sync; (total norm, skipped flag) as device scalars,
        with the semantics of `optim.guarded_step`. Gradients left pending by a deferred
        `ComputeWeights` entry (one micro-batch) are read as they are, in low precision,
        through a table of their addresses; otherwise from the float32 accumulators."""
        table = self._table_for(self.weights.pending_grads())
        if table is None:
            self.weights.materialize()
            norm = torch.linalg.vector_norm(self.grads)  # gaps are zero
        else:
            norm = table.norm()
        scale, found_inf = clip_scale_and_skip(norm, max_norm, bad)
        # a skipped step is not counted; the increment goes in as a list of tensors: a bare
        # 0-dim tensor binds to the Scalar overload, whose conversion waits for the device
        inc = 1.0 - found_inf
        torch._foreach_add_(self._steps, [inc] * len(self._steps))
        hyper = Hyper.of(self.optimizer.param_groups[0])
        # the Triton kernels write the bf16 compute copies with the masters; torch's does not
        if _bf16_copies(self) is not None and (table is not None or _triton_runs(self.masters)):
            self.weights.mark_fresh()
        else:
            self.weights.invalidate()
        if table is not None:
            table.step(self, found_inf, scale, hyper)
            self.weights.drop_pending()  # the kernel is queued: the allocator orders reuse
        elif _triton_runs(self.masters):
            _triton_step(self, found_inf, scale, hyper)
        else:
            low_moment = self.exp_avg.dtype != torch.float32
            exp_avg = self.exp_avg.float() if low_moment else self.exp_avg
            torch._fused_adamw_(
                [self.masters],
                [self.grads],
                [exp_avg],
                [self.exp_avg_sq],
                [],
                [self._steps[0].clone()],  # already incremented: the kernel reads it as is
                amsgrad=False,
                lr=hyper.lr,
                beta1=hyper.beta1,
                beta2=hyper.beta2,
                weight_decay=hyper.weight_decay,
                eps=hyper.eps,
                maximize=False,
                grad_scale=scale,
                found_inf=found_inf,
            )
            if low_moment:
                self.exp_avg.copy_(exp_avg)  # rounded to nearest, as the kernels store it
        # the schedule checks that the optimizer stepped before it (torch's flag for it)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return norm, found_inf

    def _table_for(self, pending: list[Tensor] | None) -> GradTable | None:
        """The address table pointed at pending gradients, or None: nothing pending, no
        Triton, or gradients the table cannot read (then they go to float32 first)."""
        if pending is None or not _triton_runs(self.masters):
            return None
        if self._table is None:
            self._table = GradTable(self.layout, pending[0].dtype, self.masters.device)
        return self._table if self._table.point_at(pending) else None


class GradTable:
    """Per-parameter low-precision gradients read in place by one kernel: a static table
    of (parameter, first element) per block of the flat layout, and each step the
    gradients' addresses (one small host-to-device copy)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> None:
        counts = [-(-shape.numel() // BLOCK) for shape in layout.shapes]
        param = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        first = torch.cat([torch.arange(c) * BLOCK for c in counts])
        self.blocks = len(param)
        self.block_param = param.to(device=device, dtype=torch.int32)
        self.block_first = first.to(device=device, dtype=torch.int64)
        numel = torch.tensor([s.numel() for s in layout.shapes], dtype=torch.int64)
        self.numel = numel.to(device)
        # the kernels' bound, rounded up to whole 16-byte vectors so that loads and stores
        # vectorize: the extra elements read lie in the gradient's allocation (the caching
        # allocator rounds to 512 B), count as zero, and land in the layout's zero gaps
        self.numel16 = (-(-numel // _VECTOR) * _VECTOR).to(device)
        self.offset = torch.tensor(layout.offsets, dtype=torch.int64, device=device)
        self.dtype = dtype
        self.base: Tensor | None = None
        self.deltas = torch.empty(len(counts), dtype=torch.int64, device=device)
        programs = -(-self.blocks // NORM_GROUP)  # of the norm kernel: a partial sum each
        self.partial = torch.empty(programs, dtype=torch.float32, device=device)

    def point_at(self, grads: list[Tensor]) -> bool:
        """Point the kernels at this step's gradients (each contiguous, of the table's
        dtype), as element offsets from the first one's address; False (read nothing) when
        one is not 16-byte aligned. Freeing the gradients after the kernels are queued is
        safe: the allocator hands their memory out again only to work queued later on the
        same stream."""
        size = grads[0].element_size()
        addresses = [g.data_ptr() for g in grads]
        if any(g.dtype != self.dtype for g in grads) or _VECTOR * size != 16:
            return False
        if any(a % 16 for a in addresses):
            return False
        host = torch.tensor([(a - addresses[0]) // size for a in addresses], dtype=torch.int64)
        self.deltas.copy_(host, non_blocking=True)  # small: staged at once (transfer.py)
        self.base = grads[0]
        return True

    def norm(self) -> Tensor:
        _sumsq_kernel[(self.partial.numel(),)](
            self.base,
            self.deltas,
            self.block_param,
            self.block_first,
            self.numel,
            self.numel16,
            self.partial,
            self.blocks,
            BLOCK=BLOCK,
            GROUP=NORM_GROUP,
            num_warps=4,
        )
        return self.partial.sum().sqrt()

    def step(self, flat: FlatAdamW, found_inf: Tensor, scale: Tensor | None, hyper: Hyper) -> None:
        low, store_low = _low_args(flat)
        _adamw_table_kernel[(self.blocks,)](
            flat.masters,
            self.base,
            self.deltas,
            flat.exp_avg,
            flat.exp_avg_sq,
            low,
            self.block_param,
            self.block_first,
            self.numel,
            self.numel16,
            self.offset,
            *_update_args(flat, found_inf, scale, hyper),
            HAS_SCALE=scale is not None,
            STORE_LOW=store_low,
            BLOCK=BLOCK,
            num_warps=8,
        )


def _bf16_copies(flat: FlatAdamW) -> Tensor | None:
    """The flat bf16 compute copies the kernels write with the masters (other dtypes are
    left to the refresh copy)."""
    low = flat.weights.flat_low
    return low if low is not None and low.dtype == torch.bfloat16 else None


def _low_args(flat: FlatAdamW) -> tuple[Tensor, bool]:
    """The kernels' compute-copy pointer and STORE_LOW flag (without copies to write the
    pointer is the masters', never stored through)."""
    low = _bf16_copies(flat)
    return (flat.masters, False) if low is None else (low, True)


def _triton_runs(t: Tensor) -> bool:
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _triton_step(flat: FlatAdamW, found_inf: Tensor, scale: Tensor | None, hyper: Hyper) -> None:
    n = flat.layout.total
    low, store_low = _low_args(flat)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        flat.masters,
        flat.grads,
        flat.exp_avg,
        flat.exp_avg_sq,
        low,
        n,
        *_update_args(flat, found_inf, scale, hyper),
        HAS_SCALE=scale is not None,
        STORE_LOW=store_low,
        BLOCK=BLOCK,
        num_warps=8,
    )


if triton is not None:
    from pipeline.models.bf16 import to_bf16

    @triton.jit
    def _adamw_update(
        p_ptr,
        m_ptr,
        v_ptr,
        low_ptr,
        offs,
        mask,
        g,
        step_ptr,
        scale_ptr,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_SCALE: tl.constexpr,
        STORE_LOW: tl.constexpr,
    ):
        """AdamW on the float32 masters and moments at `offs` with gradient `g` (a bf16
        first moment is read into float32 and stored rounded); with STORE_LOW the new
        masters' compute copies too."""
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        step = tl.load(step_ptr).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp(step * tl.log(beta1))
        bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        if m_ptr.dtype.element_ty == tl.bfloat16:  # the first moment in bf16, rounded
            tl.store(m_ptr + offs, to_bf16(m), mask=mask)
        else:
            tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if STORE_LOW:
            tl.store(low_ptr + offs, to_bf16(p), mask=mask)

    @triton.jit
    def _adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        low_ptr,
        n,
        step_ptr,
        found_inf_ptr,
        scale_ptr,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_SCALE: tl.constexpr,
        STORE_LOW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        # a skipped step reads and writes nothing
        limit = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
        mask = offs < limit
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        _adamw_update(
            p_ptr,
            m_ptr,
            v_ptr,
            low_ptr,
            offs,
            mask,
            g,
            step_ptr,
            scale_ptr,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            HAS_SCALE,
            STORE_LOW,
        )

    @triton.jit
    def _table_block(
        g_base,
        delta_ptr,
        block_param_ptr,
        block_first_ptr,
        numel_ptr,
        numel16_ptr,
        pid,
        BLOCK: tl.constexpr,
    ):
        """(parameter, its element offsets in table block `pid`, gradient in float32 with
        zeros past the parameter's end, the vector-rounded bound for loads and stores)."""
        i = tl.load(block_param_ptr + pid)
        offs = tl.multiple_of(tl.load(block_first_ptr + pid), BLOCK) + tl.arange(0, BLOCK)
        bound = tl.multiple_of(tl.load(numel16_ptr + i), 8)
        g_ptr = g_base + tl.multiple_of(tl.load(delta_ptr + i), 8)
        g = tl.load(g_ptr + offs, mask=offs < bound, other=0.0).to(tl.float32)
        g = tl.where(offs < tl.load(numel_ptr + i), g, 0.0)
        return i, offs, g, bound

    @triton.jit
    def _sumsq_kernel(
        g_base,
        delta_ptr,
        block_param_ptr,
        block_first_ptr,
        numel_ptr,
        numel16_ptr,
        partial_ptr,
        blocks,
        BLOCK: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in range(GROUP):  # GROUP table blocks per program; past the last, zeros
            pid = tl.program_id(0) * GROUP + j
            live = pid < blocks
            pid = tl.minimum(pid, blocks - 1)
            _, _, g, _ = _table_block(
                g_base,
                delta_ptr,
                block_param_ptr,
                block_first_ptr,
                numel_ptr,
                numel16_ptr,
                pid,
                BLOCK,
            )
            acc += tl.where(live, g * g, 0.0)
        tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    @triton.jit
    def _adamw_table_kernel(
        p_ptr,
        g_base,
        delta_ptr,
        m_ptr,
        v_ptr,
        low_ptr,
        block_param_ptr,
        block_first_ptr,
        numel_ptr,
        numel16_ptr,
        offset_ptr,
        step_ptr,
        found_inf_ptr,
        scale_ptr,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_SCALE: tl.constexpr,
        STORE_LOW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i, offs, g, bound = _table_block(
            g_base,
            delta_ptr,
            block_param_ptr,
            block_first_ptr,
            numel_ptr,
            numel16_ptr,
            tl.program_id(0),
            BLOCK,
        )
        # a skipped step reads and writes nothing
        mask = offs < tl.where(tl.load(found_inf_ptr) == 0, bound, 0)
        flat = tl.multiple_of(tl.load(offset_ptr + i), 64) + offs
        _adamw_update(
            p_ptr,
            m_ptr,
            v_ptr,
            low_ptr,
            flat,
            mask,
            g,
            step_ptr,
            scale_ptr,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            HAS_SCALE,
            STORE_LOW,
        )
