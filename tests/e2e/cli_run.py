"""A whole `pipeline run` of a profile for a test, and what its run directory holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli_run(
    runs: Path,
    name: str,
    *overrides: str,
    profile: str = "profiles/local-cpu.toml",
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> Path:
    """`pipeline run --name NAME` under `runs`; asserts exit code 0; the run directory."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pipeline.cli", "run", "--name", name, "--no-progress"),
            *("--profile", str(REPO / profile), "--run.runs_dir", str(runs), *overrides),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs / name


def log_events(log: Path, event: str) -> list[dict]:
    """The JSON log lines of one event."""
    return [
        json.loads(line)
        for line in log.read_text().splitlines()
        if line.startswith("{") and f'"{event}"' in line
    ]


def step_records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics/steps.jsonl").read_text().splitlines()]
