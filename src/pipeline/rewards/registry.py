"""Reward functions by name: the built-ins, and user functions given as `module:function`.

Every reward has verl's `compute_score` signature, so existing verl reward files work as-is:
`fn(data_source, solution_str, ground_truth, extra_info) -> float`. Built-ins are resolved
lazily from a table of import paths, which keeps this module import-light and free of cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.errors import ConfigError

RewardFn = Callable[[str, str, str, dict[str, Any] | None], float]

# Trusted, fast verifiers; the scorer runs these inline rather than in a worker process.
BUILTIN_REWARDS: dict[str, str] = {
    "auto": "pipeline.rewards.registry:auto_reward",
    "gsm8k": "pipeline.rewards.gsm8k:reward_fn",
    "math": "pipeline.rewards.math_equiv:reward_fn",
    "format": "pipeline.rewards.format:reward_fn",
    "toy_reverse": "pipeline.tasks.toy_task:reward_fn",
}

# Which built-in `auto` uses for a sample's `data_source` (verl's default_compute_score idea).
DATA_SOURCE_REWARDS: dict[str, str] = {
    "gsm8k": "gsm8k",
    "openai/gsm8k": "gsm8k",
    "math": "math",
    "lighteval/math": "math",
    "digitallearninggmbh/math-lighteval": "math",
    "huggingfaceh4/math-500": "math",
    "toy_reverse": "toy_reverse",
}


class RewardNotFound(ConfigError):
    """A reward name or `module:function` spec does not resolve to a callable."""


def is_builtin(spec: str) -> bool:
    """Whether `spec` names a trusted built-in (runs inline) rather than user code."""
    return spec in BUILTIN_REWARDS


def reward_name_for(data_source: str) -> str:
    """The built-in that `auto` uses for `data_source`; matches case-insensitively."""
    key = data_source.strip().lower()
    name = DATA_SOURCE_REWARDS.get(key) or DATA_SOURCE_REWARDS.get(key.rsplit("/", 1)[-1])
    if name is None:
        raise RewardNotFound(
            f"no built-in reward for data_source {data_source!r}; known data sources: "
            f"{', '.join(sorted(DATA_SOURCE_REWARDS))}. Set a reward for it explicitly "
            "(a built-in name or 'module:function')."
        )
    return name


def auto_reward(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """Dispatch on `data_source` to the matching built-in verifier."""
    fn = resolve(reward_name_for(data_source))
    return fn(data_source, solution_str, ground_truth, extra_info)


def resolve(spec: str) -> RewardFn:
    """The reward function `spec` names (a built-in or a user `module:function`)."""
    from pipeline.runtime.user_code import load_attr

    fn = load_attr(spec, "reward", RewardNotFound, BUILTIN_REWARDS)
    if not callable(fn):
        target = BUILTIN_REWARDS.get(spec, spec).replace(":", ".")
        raise RewardNotFound(f"reward {spec!r}: {target} is not callable")
    return fn
