"""TOML profiles layered on the defaults, dotted command-line overrides, the run directory."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pipeline.config.convert import from_dict, to_dict, validate_tree
from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_profile(path: str | Path) -> dict[str, Any]:
    """Read a TOML profile; `extends = "other.toml"` layers it on another profile."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"profile {path} not found; profiles live in profiles/ (e.g. local-cpu)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {path} is not valid TOML: {exc}") from None
    parent = data.pop("extends", None)
    if parent:
        data = _merge(read_profile(path.parent / parent), data)
    return data


def parse_value(text: str) -> Any:
    """A command-line value as TOML would read it; bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    for dotted, raw in overrides.items():
        keys = dotted.split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{dotted}: {key} is not a table")
        node[keys[-1]] = parse_value(raw)
    return data


def parse_override_args(args: list[str]) -> dict[str, str]:
    """`--learner.optim.lr 1e-6` or `--learner.optim.lr=1e-6` pairs into a dict."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.key value"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        out[key] = value
    return out


def resolve_profile(profile: str) -> Path:
    path = Path(profile)
    if path.exists() or path.suffix == ".toml":
        return path
    return Path("profiles") / f"{profile}.toml"


def load_config(
    profile: str | Path | None, overrides: dict[str, str] | None = None
) -> PipelineConfig:
    data: dict[str, Any] = read_profile(resolve_profile(str(profile))) if profile else {}
    data = apply_overrides(data, overrides or {})
    config = from_dict(PipelineConfig, data)
    validate_tree(config)
    return config


def config_from_json(text: str) -> PipelineConfig:
    config = from_dict(PipelineConfig, json.loads(text))
    validate_tree(config)
    return config


def config_to_json(config: PipelineConfig) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True)


def write_resolved(config: PipelineConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(config_to_json(config))
    return path
