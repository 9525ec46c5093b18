"""User code named in a config: `package.module:attr` or `path/to/file.py:attr`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError


def load_attr(spec: str, kind: str, error: type[ConfigError], builtins: dict[str, str]) -> Any:
    """The object `spec` names: a key of `builtins` (whose value is its import path) or
    'module:attr' / 'file.py:attr'. Every failure is `error`, naming the `kind` of thing."""
    target = builtins.get(spec, spec)
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise error(
            f"unknown {kind} {spec!r}; built-ins are {', '.join(sorted(builtins))}, and a user "
            f"{kind} is given as 'package.module:name' or 'path/to/file.py:name'"
        )
    module = (
        _import_file(Path(module_name), spec, kind, error)
        if module_name.endswith(".py")
        else _import(module_name, spec, kind, error)
    )
    obj = getattr(module, attr, None)
    if obj is None:
        raise error(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def _import(module_name: str, spec: str, kind: str, error: type[ConfigError]) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise error(
                f"{kind} {spec!r}: module {module_name!r} not found (is it installed or on "
                "PYTHONPATH?)"
            ) from exc
        raise error(f"{kind} {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise error(
            f"{kind} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc


def _import_file(path: Path, spec: str, kind: str, error: type[ConfigError]) -> Any:
    """Load a user file once per absolute path, under a name that cannot clash."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise error(f"{kind} {spec!r}: file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"pipeline_user_{kind.replace(' ', '_')}_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    file_spec = importlib.util.spec_from_file_location(name, path)
    if file_spec is None or file_spec.loader is None:
        raise error(f"{kind} {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise error(
            f"{kind} {spec!r}: executing {str(path)!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    return module
