"""The toy tool task learns (issue 35's acceptance): the profile as a user runs it, with
an episode's KV cache kept across its turns (the default) and with it off."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--name", name, "--no-progress"]
    cmd += ["--profile", str(REPO / "profiles/local-cpu-tool.toml"), "--run.runs_dir", str(runs)]
    done = subprocess.run([*cmd, *extra], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = runs / name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0
    assert summary["seconds"] < 600, summary["seconds"]
    return [json.loads(x) for x in (run / "metrics/steps.jsonl").read_text().splitlines()]


def _learned(steps: list[dict]) -> None:
    """Reward and well-used tool share from <= 0.2 over the first 3 steps (the warm-started
    policy: the profile learns within its first 10 steps) to >= 0.6 over the last 10."""
    for key in ("reward_mean", "rollout/tool_used"):
        values = [s[key] for s in steps]
        first, last = statistics.mean(values[:3]), statistics.mean(values[-10:])
        assert first <= 0.2 and last >= 0.6, (key, first, last)
    assert all(s["rollout/masked_tokens"] >= 0 for s in steps)
    assert statistics.mean(s["rollout/masked_tokens"] for s in steps[-10:]) >= 4  # " 482 ="


def _per_episode(steps: list[dict], key: str) -> float:
    return statistics.mean(s[f"rollout/{key}"] for s in steps)


@pytest.mark.slow
def test_the_toy_tool_profile_learns_with_the_kv_cache_kept_and_without(tmp_path):
    """~3 minutes each on 2 cores. Kept, the later turns prefill only the tool's tokens and
    the last sampled one: no token of an earlier turn is prefilled again, except after an
    eviction or a weight update between two turns (kv_on_update recompute)."""
    kept = _run(tmp_path, "kept")
    _learned(kept)
    off = _run(tmp_path, "off", "--environment.keep_kv", "false")
    _learned(off)
    assert _per_episode(kept, "recomputed_tokens") <= 0.2 * _per_episode(off, "recomputed_tokens")
    assert _per_episode(kept, "prefill_tokens") < _per_episode(off, "prefill_tokens")
