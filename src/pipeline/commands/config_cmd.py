"""`pipeline config show` (the resolved config of a profile and overrides) and `pipeline
config keys` (every key with its default and what it does, from the schema's comments)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import typing
from typing import Any

from pipeline.config import PipelineConfig, load_config, parse_override_args
from pipeline.config.convert import to_dict

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=]+(?:=.*)?$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's comment: the `#` lines right above it, or its trailing `# ...`; an
    inherited field's from the class that declares it."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not cls and dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return {**docs, **_own_field_docs(cls)}


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# ").strip())
            continue
        match = _FIELD.match(line.split("  #")[0]) if line.startswith("    ") else None
        if match and not stripped.startswith(("def ", "return", "@")):
            name = match.group(1)
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            text = " ".join(pending) or trailing
            if text:
                docs[name] = text
        pending = []
    return docs


def _short(text: str, width: int = 110) -> str:
    first = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0]
    return first if len(first) <= width else first[: width - 1] + "…"


def schema_rows(cls: type, value: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, one-line doc) of every leaf key under `cls`; a table of named
    entries (pools, services) is shown through its first entry as `*`."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}.{f.name}" if prefix else f.name
        current = getattr(value, f.name)
        args = typing.get_args(tp)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows += schema_rows(tp, current, path)
        elif (
            typing.get_origin(tp) is dict
            and args
            and isinstance(args[1], type)
            and dataclasses.is_dataclass(args[1])
        ):
            entry = args[1]()
            rows += schema_rows(args[1], entry, f"{path}.*")
        else:
            rows.append((path, current, _short(docs.get(f.name, ""))))
    return rows


def config_command(args: argparse.Namespace, rest: list[str]) -> int:
    if args.config_command == "keys":
        for key, default, doc in schema_rows(PipelineConfig, PipelineConfig()):
            shown = json.dumps(default) if not isinstance(default, str) else repr(default)
            print(f"{key} = {shown}" + (f"  # {doc}" if doc else ""))
        return 0
    config = load_config(args.profile, parse_override_args(rest))
    print(json.dumps(to_dict(config), indent=2, sort_keys=True))
    return 0
