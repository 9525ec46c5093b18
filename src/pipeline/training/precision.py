"""Low-precision compute over float32 master weights, for a single (unsharded) process.

FSDP2 casts parameters to the compute dtype by itself. A single process used to rely on
autocast instead, which leaves the embeddings' output in float32, so every elementwise op
of the trunk (RoPE, norms, residuals) ran in float32 and attention fell back from flash
varlen to a dense masked kernel. `ComputeWeights` gives a single process what FSDP gives a
sharded one:

  * inside `with compute_weights():` every parameter's `.data` is a bfloat16 (or float16)
    copy of its float32 master, refreshed on entry by one foreach copy, so the whole
    forward and backward run in the compute dtype;
  * each parameter's gradient is moved into a float32 accumulator as soon as autograd has
    accumulated it (a post-accumulate-grad hook), so micro-batches add up in float32;
  * on exit the masters are back in `.data` with the float32 gradients in `.grad`:
    clipping, the optimizer, checkpoints, exports and weight sync see float32 as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


class ComputeWeights:
    """Swaps low-precision compute copies in and out of a module's parameters."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params: list[nn.Parameter] = list(model.parameters())  # shared ones once
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._low: list[Tensor] = [torch.empty_like(p, dtype=dtype) for p in self.params]
        self._grads: list[Tensor | None] = [None] * len(self.params)
        self.active = False
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._to_float32_grad)

    def _to_float32_grad(self, p: Tensor) -> None:
        if not self.active or p.grad is None:
            return
        i = self._index[id(p)]
        acc = self._grads[i]
        if acc is None:
            self._grads[i] = p.grad.float()
        else:
            acc.add_(p.grad)
        p.grad = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Compute in low precision inside; float32 masters and gradients outside. Nested
        uses share the outer one."""
        if self.active:
            yield
            return
        masters = [p.data for p in self.params]  # read each time: a checkpoint load may
        with torch.no_grad():  # have replaced them
            torch._foreach_copy_(self._low, masters)
        for i, (p, low) in enumerate(zip(self.params, self._low, strict=True)):
            self._grads[i], p.grad = p.grad, None  # float32 gradients so far keep adding up
            p.data = low
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for i, (p, master) in enumerate(zip(self.params, masters, strict=True)):
                p.data = master
                # inside, every gradient went to the accumulator (p.grad was left None)
                p.grad, self._grads[i] = self._grads[i], None
