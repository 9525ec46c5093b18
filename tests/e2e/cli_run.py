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


def assert_replay_matches(
    run: Path, out: Path, keys: tuple[str, ...], timeout: float = 600
) -> None:
    """`pipeline replay RUN --service learner --out OUT` gives the recorded run's learner
    bit for bit: the same `keys` at every step and the same final weights."""
    from safetensors.torch import load_file

    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pipeline.cli", "replay", str(run)),
            *("--service", "learner", "--out", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    original = {s["step"]: s for s in step_records(run)}
    replayed = [
        json.loads(x)
        for x in (out / "metrics/learner-0.jsonl").read_text().splitlines()
        if '"kind"' not in x
    ]
    assert [r["step"] for r in replayed] == sorted(original)
    for r in replayed:
        for key in keys:
            assert r[key] == original[r["step"]][key], (r["step"], key)
    before = load_file(str(run / "final_model/model.safetensors"))
    after = load_file(str(out / "final_model/model.safetensors"))
    assert before.keys() == after.keys()
    assert all(before[k].equal(after[k]) for k in before)
