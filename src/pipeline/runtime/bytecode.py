"""Python's bytecode cache for the services where the installed packages hold none.

On an image whose site-packages is read-only, or that sets PYTHONDONTWRITEBYTECODE, every
process compiles torch's ~2,500 modules from source: seconds of each service's start, and
again in each of inductor's compile workers. There the services keep their bytecode under
the run's compile cache instead (PYTHONPYCACHEPREFIX), so the second start reads it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class BytecodeCache:
    prefix: str
    reason: str

    def apply(self, env: dict[str, str]) -> None:
        env["PYTHONPYCACHEPREFIX"] = self.prefix
        env.pop("PYTHONDONTWRITEBYTECODE", None)


def bytecode_cache(
    cache_root: str, environ: Mapping[str, str], package: str = "torch"
) -> BytecodeCache | None:
    """Where the services should keep bytecode, or None where Python already caches
    `package`'s (or will, on its first import), the user chose a prefix, or there is no
    cache root."""
    if not cache_root or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    prefix = os.path.join(os.path.expanduser(cache_root), "pycache")
    if environ.get("PYTHONDONTWRITEBYTECODE"):
        return BytecodeCache(prefix, "PYTHONDONTWRITEBYTECODE is set")
    cache_dir = os.path.join(os.path.dirname(spec.origin), "__pycache__")
    writable = cache_dir if os.path.isdir(cache_dir) else os.path.dirname(spec.origin)
    if not os.access(writable, os.W_OK):
        return BytecodeCache(prefix, f"{writable} is read-only")
    return None
