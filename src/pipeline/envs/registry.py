"""Environments by name: the built-ins, and user classes given as `module:Class`."""

from __future__ import annotations

from typing import Any

from pipeline.envs.types import EnvironmentNotFound

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "toy_lookup": "pipeline.envs.toy_lookup:LookupEnv",
    "gsm8k_python": "pipeline.envs.python_tool:PythonToolEnv",
}


def resolve(spec: str) -> type[Any]:
    """The environment class `spec` names."""
    from pipeline.runtime.user_code import load_attr

    cls = load_attr(spec, "environment", EnvironmentNotFound, BUILTIN_ENVIRONMENTS)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise EnvironmentNotFound(f"environment {spec!r} is not a class with a step method")
    return cls
