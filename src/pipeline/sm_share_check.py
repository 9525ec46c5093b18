"""A service capped to a share of the GPU's SMs (`services.ROLE.gpu_share` under CUDA MPS)
checks, before its first batch, that its matrix products are right and that its model's
forward gives the same result twice.

On an H100 under MPS, cuBLAS matrix products came out wrong at 80 % of the SMs (104), and
at 70 % (92) the backward went wrong (its op not yet traced): the policy trained on
gradients 4000 times too large while its log-probs still matched (docs/performance.md).
So the check multiplies random matrices of the shapes the model's layers run, forward and
both backward products, against a float32 host reference on a sample of rows and
columns, then computes the forward of a step's batch twice. A service that fails
either refuses the share at start, naming the setting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError
from pipeline.runtime.gpu_sharing import SHARE_ENV

if TYPE_CHECKING:
    from torch import Tensor

    from pipeline.config import PipelineConfig


class SmShareRefused(ConfigError):
    """A service's results were not repeatable with the SM share it was given."""


def sm_share(env: Mapping[str, str] = os.environ) -> int | None:
    """This process's SM percentage under MPS when below 100, else None."""
    text = env.get(SHARE_ENV, "").strip()
    if not text:
        return None
    share = int(float(text))
    return share if share < 100 else None


def check_repeatable(role: str, what: str, share: int, compute: Callable[[], Tensor]) -> float:
    """`compute()` twice: the same values, all finite, or SmShareRefused. Returns the
    seconds both took."""
    import torch

    start = time.perf_counter()
    first = compute().float().cpu()
    again = compute().float().cpu()
    seconds = time.perf_counter() - start
    finite = torch.isfinite(first) & torch.isfinite(again)
    bad = int((~finite).sum())
    gap = float((first - again).abs()[finite].max()) if bool(finite.any()) else 0.0
    if bad == 0 and gap == 0.0:
        return seconds
    found = [f"differ by up to {gap:.3g}"] if gap else []
    found += [f"give {bad} non-finite values"] if bad else []
    raise SmShareRefused(
        f"services.{role}.gpu_share = {share}: two computations of the same batch's {what} "
        f"on {share} % of the GPU's SMs {' and '.join(found)}, so the run would train on "
        "wrong numbers (a defect seen with some shares, docs/performance.md); set "
        f"services.{role}.gpu_share = 0 (the whole GPU) or another share"
    )


def check_sm_share(
    log: Any,
    config: PipelineConfig,
    role: str,
    parts: list[Any],
    env: Mapping[str, str] = os.environ,
) -> None:
    """Each part's forward (a policy's or reference's log-probs, a critic's values) checked
    by `check_repeatable` on a step's worth of full-length samples, when this process has
    an SM share below 100; nothing otherwise."""
    share = sm_share(env)
    parts = [p for p in parts if p is not None]
    if share is None or not parts:
        return
    from pipeline.trainer_setup import warm_up_batches

    seconds = check_part_products(role, share, parts)
    log.info("sm_share_checked", share=share, what="matrix products", seconds=round(seconds, 2))
    batch = warm_up_batches(config, parts[0].model.config.vocab_size)[0]
    for part in parts:
        what, forward = _forward(part)
        seconds = check_repeatable(role, what, share, lambda f=forward: f(batch))
        log.info("sm_share_checked", share=share, what=what, seconds=round(seconds, 2))


def product_shapes(part: Any) -> list[tuple[int, int, int]]:
    """(rows, inner, out) of each layer's forward product at the part's micro-batch sizes:
    every 2-D weight's shape at the training and the no-grad token counts; the output
    layer's (vocabulary rows) at its log-prob chunk, and at the training count too where
    the logits are kept for backward (one product over the micro-batch)."""
    cfg = part.config
    train = cfg.max_tokens_per_micro_batch
    counts = {train, cfg.infer_max_tokens_per_micro_batch or train}
    weights = {tuple(p.shape) for p in part.model.parameters() if p.dim() == 2}
    shapes = set()
    for out, inner in weights:
        rows = counts
        if out == part.model.config.vocab_size:
            rows = {min(n, cfg.logprob_chunk_tokens) for n in counts}
            rows |= {train} if cfg.logprob_keep_logits else set()
        shapes |= {(n, inner, out) for n in rows}
    return sorted(shapes)


def check_products(
    role: str,
    share: int,
    shapes: list[tuple[int, int, int]],
    device: Any,
    dtype: Any,
    matmul: Callable[[Tensor, Tensor], Tensor] | None = None,
    sample: int = 64,
) -> float:
    """For each (rows, inner, out): the forward product x @ w.T and the backward ones (the
    input's gradient g @ w, the weight's g.T @ x) of random matrices in `dtype` on
    `device`, compared on `sample` rows (columns of the weight's) with float32 products on
    the host; SmShareRefused where one is off by more than 2 % of its largest value or not
    finite. Returns the seconds it took."""
    import torch

    mm = matmul or torch.matmul
    start = time.perf_counter()
    gen = torch.Generator(device).manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    for rows, inner, out in shapes:
        x, w, g = randn(rows, inner), randn(out, inner, scale=inner**-0.5), randn(rows, out)
        take = torch.randperm(rows, generator=gen, device=device)[:sample]
        cols = torch.randperm(out, generator=gen, device=device)[:sample]
        host_w = w.float().cpu()
        products = {  # what the device computed, what the host does in float32
            "forward": (mm(x, w.T)[take], x[take].float().cpu() @ host_w.T),
            "input gradient": (mm(g, w)[take], g[take].float().cpu() @ host_w),
            "weight gradient": (mm(g.T, x)[cols], g[:, cols].float().cpu().T @ x.float().cpu()),
        }
        for name, (got, want) in products.items():
            got = got.float().cpu()
            err = float((got - want).abs().nan_to_num(float("inf")).max())
            scale = float(want.abs().max())
            if not err <= 0.02 * scale:
                raise SmShareRefused(
                    f"services.{role}.gpu_share = {share}: the {name} product of a layer "
                    f"{inner} -> {out} at {rows} tokens, on {share} % of the GPU's SMs, is "
                    f"off by up to {err:.3g} (values up to {scale:.3g}), so the run would "
                    "train on wrong numbers (a defect of matrix products under some "
                    "shares, docs/performance.md); set "
                    f"services.{role}.gpu_share = 0 (the whole GPU) or another share"
                )
    return time.perf_counter() - start


def check_part_products(role: str, share: int, parts: list[Any]) -> float:
    """`check_products` of the parts' layers, each shape once on each device and dtype
    (a critic and the reference it hosts have the same layers). Returns the seconds."""
    shapes: dict[tuple[Any, Any], set[tuple[int, int, int]]] = {}
    for part in parts:
        device = part.info.device
        key = (device, part.config.compute_dtype(device))
        shapes.setdefault(key, set()).update(product_shapes(part))
    return sum(
        check_products(role, share, sorted(todo), device, dtype)
        for (device, dtype), todo in shapes.items()
    )


def _forward(part: Any) -> tuple[str, Callable[[Any], Tensor]]:
    """What a part computes for a batch: log-probs (policy, reference) or values (critic)."""
    for name, what in (
        ("compute_logprobs", "log-probs"),
        ("logprobs", "reference log-probs"),
        ("compute_values", "values"),
    ):
        if callable(method := getattr(part, name, None)):
            return what, method
    raise TypeError(f"{type(part).__name__} has no forward to check")
