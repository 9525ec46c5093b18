"""The flat AdamW's two gradient paths timed on a trainer's own parameters (learner_step).

One micro-batch per update leaves its bf16 gradients pending and `FlatAdamW` reads them in
place (norm + update through `GradTable`); several micro-batches accumulate in float32 and
the update reads the flat float32 buffer after the copy. Both run here on the same random
bf16 gradients, each timed over `repeats` updates with the device drained: the in-place
path against the float32 copy + norm + flat update it replaces. The trainer's weights and
moments change (run it after the timed steps).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.rollout_decode import timed


def optimizer_paths(engine: Any, device: torch.device, repeats: int = 5) -> dict[str, Any]:
    """{"in_place_ms", "float32_ms", "in_place_used", "norms"} for the engine's flat
    optimizer, or {} when the engine has none."""
    flat, weights = engine._flat, engine._compute  # the bench reaches into the engine
    if flat is None or weights is None or flat.disabled:
        return {}
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [
        torch.randn(p.shape, device=device, dtype=weights.dtype, generator=gen) * 1e-3
        for p in weights.params
    ]
    buffers = [weights._buffer(i) for i in range(len(weights.params))]
    for p, buf in zip(weights.params, buffers, strict=True):
        p.grad = buf  # what a deferred exit leaves: the accumulators' views
    if not flat.ready():
        engine.optimizer.zero_grad(set_to_none=True)
        return {}
    ok = torch.zeros((), dtype=torch.bool, device=device)

    def float32_path() -> torch.Tensor:
        torch._foreach_copy_(buffers, grads)  # the flush a deferred entry skips
        return flat.guarded_step(1.0, ok)[0]

    def in_place_path() -> torch.Tensor:
        weights._pending = list(grads)
        norm = flat.guarded_step(1.0, ok)[0]
        weights.drop_pending()
        return norm

    out: dict[str, Any] = {}
    norms = {}
    for name, path in (("float32", float32_path), ("in_place", in_place_path)):
        path()  # warm-up (kernel compilation)
        runs = [timed(path, device) for _ in range(repeats)]
        out[f"{name}_ms"] = round(statistics.median(s for s, _ in runs) * 1e3, 3)
        norms[name] = float(runs[-1][1])
    out["in_place_used"] = flat._table is not None
    out["norms"] = norms
    engine.optimizer.zero_grad(set_to_none=True)
    return out
