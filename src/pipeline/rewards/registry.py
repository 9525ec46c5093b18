"""Reward functions by name: the built-ins, and user functions given as `module:function`.

Every reward has verl's `compute_score` signature, so existing verl reward files work as-is:
`fn(data_source, solution_str, ground_truth, extra_info) -> float`. Built-ins are resolved
lazily from a table of import paths, which keeps this module import-light and free of cycles.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

RewardFn = Callable[[str, str, str, dict[str, Any] | None], float]

# Trusted, fast verifiers; the scorer runs these inline rather than in a worker process.
BUILTIN_REWARDS: dict[str, str] = {
    "auto": "pipeline.rewards.registry:auto_reward",
    "gsm8k": "pipeline.rewards.gsm8k:reward_fn",
    "math": "pipeline.rewards.math_equiv:reward_fn",
    "format": "pipeline.rewards.format:reward_fn",
    "toy_reverse": "pipeline.data.toy_task:reward_fn",
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


def available() -> list[str]:
    """Names of the built-in rewards, for error messages and `--help`."""
    return sorted(BUILTIN_REWARDS)


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
    """The callable for a built-in name, `package.module:function` or `path/file.py:function`."""
    target = BUILTIN_REWARDS.get(spec, spec)
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardNotFound(
            f"unknown reward {spec!r}; built-ins are {', '.join(available())}, and a user "
            "function is given as 'package.module:function' or 'path/to/file.py:function'"
        )
    module = _import(module_name, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardNotFound(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardNotFound(f"reward {spec!r}: {module_name}.{attr} is not callable")
    return fn


def _import(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        return _import_file(Path(module_name), spec)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise RewardNotFound(
                f"reward {spec!r}: module {module_name!r} not found (is it installed or on "
                "PYTHONPATH?)"
            ) from exc
        raise RewardNotFound(f"reward {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise RewardNotFound(
            f"reward {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc


def _import_file(path: Path, spec: str) -> Any:
    """Load a reward file once per absolute path, under a name that cannot clash."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise RewardNotFound(f"reward {spec!r}: file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"pipeline_user_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    file_spec = importlib.util.spec_from_file_location(name, path)
    if file_spec is None or file_spec.loader is None:
        raise RewardNotFound(f"reward {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardNotFound(
            f"reward {spec!r}: executing {str(path)!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    return module
