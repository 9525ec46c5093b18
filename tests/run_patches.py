"""The environment of a test's run whose processes take patches no run config sets
(tests/run_patches_site: `compiled_cpu`, `short_sync`)."""

from __future__ import annotations

import os
from pathlib import Path

SITE = Path(__file__).resolve().parent / "run_patches_site"


def patch_vars(*patches: str) -> dict[str, str]:
    """The two variables that turn the patches on, over this process's PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "PIPELINE_TEST_PATCHES": ",".join(patches)}


def patched_env(*patches: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment) with the patches on."""
    return {**(os.environ if base is None else base), **patch_vars(*patches)}
