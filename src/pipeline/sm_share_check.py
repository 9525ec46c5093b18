"""A service capped to a share of the GPU's SMs (`services.ROLE.gpu_share` under CUDA MPS)
checks, before its first batch, that its model's forward gives the same result twice.

On an H100 the learner's log-probs at 80 % of the SMs differed between two computations
of the same batch by up to 2.8 and were NaN in a whole run, where at 100 % they were
bitwise equal (docs/performance.md, "SM share"); the cause is not found yet. A run that
meets it would train on wrong log-probs until every update is skipped, so the service
refuses the share at start instead, naming the setting.
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

    batch = warm_up_batches(config, parts[0].model.config.vocab_size)[0]
    for part in parts:
        what, forward = _forward(part)
        seconds = check_repeatable(role, what, share, lambda f=forward: f(batch))
        log.info("sm_share_checked", share=share, what=what, seconds=round(seconds, 2))


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
