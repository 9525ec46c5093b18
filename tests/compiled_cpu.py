"""The environment of a test's run whose CPU trainers compile (tests/compiled_cpu_site)."""

from __future__ import annotations

import os
from pathlib import Path

SITE = Path(__file__).resolve().parent / "compiled_cpu_site"


def compiled_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    return env
