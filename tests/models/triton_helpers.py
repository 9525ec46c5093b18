"""Running a Triton kernel check in a subprocess: under the interpreter on CPU
(TRITON_INTERPRET=1 must be set before Triton compiles anything), compiled on a GPU host."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

HAS_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "Triton is not installed (CPU builds of torch)"


def run_script(script: str, **env: str) -> str:
    path = os.pathsep.join(["src", "tests", os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **env, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def interpret(script: str) -> str:
    return run_script(script, TRITON_INTERPRET="1")
