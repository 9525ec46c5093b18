"""Typed configuration: defaults in one place, TOML profiles, dotted overrides."""

from pipeline.config.profile import (
    config_from_json,
    config_to_json,
    load_config,
    parse_override_args,
    write_resolved,
)
from pipeline.config.schema import PipelineConfig

__all__ = [
    "PipelineConfig",
    "config_from_json",
    "config_to_json",
    "load_config",
    "parse_override_args",
    "write_resolved",
]
