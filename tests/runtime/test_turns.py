"""Turns (`run.gpu_sharing`): the learner pauses the engines while it trains a step, and
they resume once that step's weights are applied, their running samples kept (prefilled
again under the new weights, or with `rollout.kv_on_update` keep, not)."""

from __future__ import annotations

import json

from tests.e2e.cli_run import cli_run, step_records
from tests.runtime.budget_rows import budget_rows


def _long_rows(tmp_path):
    """Rows whose samples run to the run's 48 tokens: each says ignore_eos."""
    return str(budget_rows(tmp_path / "data.jsonl", [None] * 64, ignore_eos=True))


def test_the_engine_pauses_while_each_step_trains_and_nothing_is_lost(tmp_path):
    steps = 8
    run = cli_run(
        tmp_path,
        "turns",
        *("--run.gpu_sharing", "turns", "--controller.max_staleness", "1"),
        *("--controller.steps", str(steps), "--task.warm_start_steps", "0"),
        *("--task.dataset", _long_rows(tmp_path), "--rollout.max_new_tokens", "48"),
        timeout=600,
    )
    supervisor = json.loads((run / "supervisor.json").read_text())
    assert supervisor["gpu_sharing"]["mode"] == "turns"
    records = step_records(run)
    assert len(records) == steps
    # the engine's count of pauses, as its later groups report it: one a step
    pauses = max(r.get("rollout/pauses", 0) for r in records)
    assert pauses >= steps - 2, [r.get("rollout/pauses") for r in records]
    paused = max(r.get("rollout/paused_s", 0) for r in records)
    trained = sum(r["step_seconds"] for r in records[:-1])
    # paused while the steps trained (the last step's groups left before it began)
    assert paused > 0.5 * trained, (paused, trained)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["dropped"] == 0, summary
    # samples ran across the pauses and were prefilled again under the new weights
    assert max(r.get("rollout/recomputed_rows", 0) for r in records) > 0


def test_kept_keys_and_values_are_not_prefilled_again(tmp_path):
    run = cli_run(
        tmp_path,
        "keep",
        *("--rollout.kv_on_update", "keep", "--controller.max_staleness", "1"),
        *("--controller.steps", "4", "--task.warm_start_steps", "0"),
        *("--task.dataset", _long_rows(tmp_path), "--rollout.max_new_tokens", "48"),
        timeout=600,
    )
    records = step_records(run)
    assert len(records) == 4
    assert all(r["rollout/recomputed_rows"] == 0 for r in records)
