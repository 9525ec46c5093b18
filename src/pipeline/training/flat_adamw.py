"""AdamW over flat buffers: one kernel for every parameter of a single process.

torch's fused AdamW walks the ~290 tensors of a 0.5B model in many launches of a few hundred
blocks each and reached ~2.9 TB/s on an H200 (4.7 ms a step). Here the float32 masters,
their gradient accumulators (both set up flat by `ComputeWeights(flat=True)`) and Adam's two
moments are views of four flat buffers, and one Triton kernel streams them once: 28 bytes
per parameter. Parameters, gradients and optimizer state keep their per-parameter shapes and
names, so checkpoints, exports and weight sync see nothing different.

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
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pipeline.training.optim import clip_scale_and_skip

if TYPE_CHECKING:  # precision.py imports FlatLayout from here
    from pipeline.training.precision import ComputeWeights

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None  # type: ignore[assignment]

ALIGN = 64  # elements: every view starts 256 B (float32) / 128 B (bfloat16) aligned
BLOCK = 2048


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


class FlatAdamW:
    """Steps a torch AdamW's parameters through flat buffers (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.AdamW, weights: ComputeWeights) -> None:
        """`weights` must have been built with flat=True (it holds the masters and the
        gradient accumulators); the moments' buffers are this object's."""
        if weights.layout is None or weights.flat_masters is None or weights.flat_grads is None:
            raise ValueError("FlatAdamW needs ComputeWeights(..., flat=True)")
        self.optimizer = optimizer
        self.params = weights.params
        self.layout = weights.layout
        self.masters, self.grads = weights.flat_masters, weights.flat_grads
        self.exp_avg = self.layout.buffer(self.masters, torch.float32)
        self.exp_avg_sq = self.layout.buffer(self.masters, torch.float32)
        self._steps: list[Tensor] = []
        self.disabled = False
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
        leaves behind), the flat path stays off."""
        if not self.disabled:
            self.disabled = not self._check()
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
        with the semantics of `optim.guarded_step`."""
        norm = torch.linalg.vector_norm(self.grads)  # gaps are zero
        scale, found_inf = clip_scale_and_skip(norm, max_norm, bad)
        # a skipped step is not counted; the increment goes in as a list of tensors: a bare
        # 0-dim tensor binds to the Scalar overload, whose conversion waits for the device
        inc = 1.0 - found_inf
        torch._foreach_add_(self._steps, [inc] * len(self._steps))
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        args = (float(group["lr"]), float(beta1), float(beta2))
        args += (float(group["eps"]), float(group["weight_decay"]))
        if _triton_runs(self.masters):
            _triton_step(self, found_inf, scale, *args)
        else:
            torch._fused_adamw_(
                [self.masters],
                [self.grads],
                [self.exp_avg],
                [self.exp_avg_sq],
                [],
                [self._steps[0].clone()],  # already incremented: the kernel reads it as is
                amsgrad=False,
                lr=args[0],
                beta1=args[1],
                beta2=args[2],
                weight_decay=args[4],
                eps=args[3],
                maximize=False,
                grad_scale=scale,
                found_inf=found_inf,
            )
        # the schedule checks that the optimizer stepped before it (torch's flag for it)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return norm, found_inf


def _triton_runs(t: Tensor) -> bool:
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _triton_step(
    flat: FlatAdamW,
    found_inf: Tensor,
    scale: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    n = flat.layout.total
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        flat.masters,
        flat.grads,
        flat.exp_avg,
        flat.exp_avg_sq,
        flat._steps[0],
        found_inf,
        scale if scale is not None else found_inf,  # unread without HAS_SCALE
        n,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_SCALE=scale is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        step_ptr,
        found_inf_ptr,
        scale_ptr,
        n,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        # a skipped step reads and writes nothing
        limit = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
        mask = offs < limit
        step = tl.load(step_ptr).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp(step * tl.log(beta1))
        bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
