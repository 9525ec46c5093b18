"""Per-prompt response budgets: a dataset row's `max_new_tokens`, at most the run's
`rollout.max_new_tokens`, is what the engine is given for that prompt, and is recorded."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import PipelineConfig
from pipeline.data.loader import load_prompts
from pipeline.data.records import BadRowError
from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
from pipeline.errors import ConfigError
from pipeline.runtime.journal import ReleasedPrompt, RunState
from services.controller.service import Controller
from tests.runtime.budget_rows import budget_rows

REPO = Path(__file__).resolve().parents[2]


def test_a_row_may_carry_its_budget_and_a_bad_one_names_the_row(tmp_path):
    records = load_prompts(budget_rows(tmp_path / "ok.jsonl", [5, None, 12]))
    assert [r.max_new_tokens for r in records] == [5, 0, 12]
    for bad in (0, -3, "7", 2.5, True):
        path = budget_rows(tmp_path / "bad.jsonl", [4, bad])
        with pytest.raises(BadRowError, match=r"row 1.*max_new_tokens"):
            load_prompts(path)


def test_a_budget_above_the_runs_limit_is_refused_at_load(tmp_path):
    from pipeline.tasks.prepare import prepare_task

    path = budget_rows(tmp_path / "data.jsonl", [4, 40])
    base = PipelineConfig()
    config = dataclasses.replace(
        base,
        task=dataclasses.replace(base.task, dataset=str(path), warm_start_steps=0),
        rollout=dataclasses.replace(base.rollout, max_new_tokens=16),
    )
    with pytest.raises(ConfigError, match=r"'r1'.*max_new_tokens 40.*rollout.max_new_tokens 16"):
        prepare_task(config, tmp_path / "run")


def test_the_prompt_sent_carries_the_rows_budget_or_the_runs_limit(tmp_path):
    base = PipelineConfig()
    config = dataclasses.replace(
        base, rollout=dataclasses.replace(base.rollout, max_new_tokens=200)
    )
    controller = Controller(config, tmp_path / "run")
    save_char_tokenizer(tmp_path / "tok")
    controller._tokenizer = load_tokenizer(tmp_path / "tok")
    own = ReleasedPrompt("000001:a", "1+1=", "toy", "2", 0, max_new_tokens=37)
    plain = ReleasedPrompt("000002:b", "1+1=", "toy", "2", 0)
    assert controller.encode(own)[0].max_new_tokens == 37
    assert controller.encode(plain)[0].max_new_tokens == 200
    # a restarted controller reads the budget back from its journal: the same prompt again
    state = RunState()
    state.apply(json.loads(json.dumps({"kind": "release", "prompts": [dataclasses.asdict(own)]})))
    assert state.released == [own]


def test_a_run_gives_each_prompt_its_budget_and_records_it(tmp_path):
    """Responses that never stop (each row says ignore_eos) end exactly at their row's
    budget."""
    budgets = [3, 9, None, 5] * 4
    data = budget_rows(tmp_path / "data.jsonl", budgets, ignore_eos=True)
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run", "--no-progress",
        "--profile", str(REPO / "profiles/local-cpu.toml"),
        "--name", "budgets", "--run.runs_dir", str(runs),
        "--task.dataset", str(data), "--task.warm_start_steps", "0",
        "--rollout.max_new_tokens", "7",
        "--rollout.n_samples", "2", "--controller.prompts_per_step", "8",
        "--controller.steps", "2", "--services.reward.replicas", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    # a budget above the run's limit: refused before any service starts
    assert proc.returncode != 0 and "max_new_tokens 9" in proc.stdout + proc.stderr
    data = budget_rows(tmp_path / "data.jsonl", [3, 6, None, 5] * 4, ignore_eos=True)
    cmd[cmd.index("budgets")] = "budgets-ok"
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from pipeline.wire.recording import QueueReader

    want = {f"r{i}": b or 7 for i, b in enumerate([3, 6, None, 5] * 4)}
    seen = 0
    for record in QueueReader(runs / "budgets-ok/queues/scored.log"):
        body = record.decode().body
        budget = want[body.uid.split(":", 1)[1]]
        assert body.max_new_tokens == budget
        lengths = {len(record.decode().tensor(s.response_ids)) for s in body.samples}
        assert lengths == {budget}, (body.uid, lengths)
        seen += 1
    assert seen >= 16
