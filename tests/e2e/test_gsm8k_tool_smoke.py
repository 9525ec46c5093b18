"""GSM8K with the Python tool: profiles/local-cpu-gsm8k-tool.toml runs 3 steps with the random
tiny model (real services, the GSM8K fixture) and leaves no environment worker behind; the
test split fits the profile's prompt limit; and a scripted policy's tool call goes through
the char tokenizer, the episode driver and the environment workers, and its answer scores 1.

A random model almost never writes a ```python block, so the run checks the episode path
(turns, final answers, counters), the scripted episode the tool call itself; the environment
alone in its worker is tests/envs/test_python_tool_env.py's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config.schema import EnvironmentConfig
from pipeline.data.gsm8k import convert_gsm8k
from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
from pipeline.envs.episode import EpisodeDriver
from pipeline.envs.pool import EnvPool
from pipeline.wire.messages import Prompt, TensorRef
from pipeline.wire.recording import QueueReader
from pipeline.wire.samples import SampleArrays, read_group
from tests.e2e.cli_run import REPO, cli_run, log_events, step_records
from tests.gsm8k_fixture import write_gsm8k_fixture

PROFILE = "profiles/local-cpu-gsm8k-tool.toml"
TEST_SPLIT = REPO.parent / "shared/data/gsm8k/test.jsonl"
CALL = "She sells what is left:\n```python\nprint((16 - 3 - 4) * 2)\n```"
OUTPUT = "\n<output>\n18\n</output>\n"
ANSWER = "So she makes 18 dollars.\n#### 18"


def test_profile_runs_three_steps_on_gsm8k(tmp_path: Path) -> None:
    fixture = write_gsm8k_fixture(tmp_path / "data")
    run = cli_run(
        tmp_path / "runs",
        "gsm8k-tool",
        *("--task.dataset", str(fixture.rl_parquet)),
        *("--controller.steps", "3", "--task.warm_start_steps", "0"),
        profile=PROFILE,
        timeout=300,
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 3 and summary["duplicates"] == 0
    steps = step_records(run)
    assert len(steps) == 3
    for step in steps:
        assert step["rollout/turns"] >= 1
        assert {"rollout/tool_calls", "rollout/masked_tokens", "rollout/env_errors"} <= set(step)
    groups = [read_group(r.decode()) for r in QueueReader(run / "queues/scored.log")]
    assert groups and all(g.data_source == "openai/gsm8k" for g in groups)
    for sample in (s for g in groups for s in g.samples):
        assert len(sample.extra["loss_mask"]) == len(sample.response_ids) <= 64
        assert sample.score in (0.0, 1.0)
    counters = [
        json.loads(x)
        for x in (run / "metrics/rollout-0.jsonl").read_text().splitlines()
        if '"env.episodes"' in x
    ]
    assert counters, "the rollout never reported its environment counters"
    last = counters[-1]
    assert last["env.episodes"] >= summary["trained"] * 4  # n_samples episodes a prompt
    assert last["env.errors"] == last["env.timeouts"] == last["env.lost"] == 0
    (ready,) = log_events(run / "logs/rollout-0.log", "environment_ready")
    assert len(ready["pids"]) == 2
    alive = [p for p in ready["pids"] if _is_env_worker(p)]
    assert not alive, f"environment workers {alive} outlived the run"


def test_test_split_fits_the_profile_prompt_limit(tmp_path: Path) -> None:
    if not TEST_SPLIT.is_file():
        pytest.skip(f"the GSM8K test split is not at {TEST_SPLIT}")
    import tomllib

    from pipeline.data.formats import write_rows
    from pipeline.data.loader import load_prompts

    limit = tomllib.loads((REPO / PROFILE).read_text())["task"]["max_prompt_tokens"]
    rows = [json.loads(line) for line in TEST_SPLIT.read_text().splitlines() if line.strip()]
    tokenizer = load_tokenizer(save_char_tokenizer(tmp_path / "tok"))
    path = write_rows(convert_gsm8k(rows, split="test"), tmp_path / "test.jsonl")
    records = load_prompts(path, tokenizer=tokenizer)
    longest = max(len(tokenizer.encode(r.prompt_text)) for r in records)
    assert len(records) == len(rows) and longest <= limit, (longest, limit)


class ScriptedRunner:
    """An engine runner whose turns are given texts, each ended by end-of-sequence."""

    version = 0

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate_turn(self, request: Prompt, ids: np.ndarray, extra_stop_ids, session):
        """The next scripted turn; no prompt token served from a kept cache."""
        encoded = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        response = np.asarray([*encoded, self.tokenizer.eos_token_id], np.int32)
        sample = SampleArrays(
            uid=request.uid,
            response_ids=response,
            behaviour_logprobs=np.full(len(response), -0.5, np.float32),
            token_versions=np.zeros(len(response), np.int32),
            finish_reason="stop",
        )
        return sample, 0, False

    def release(self, session: str) -> None:
        """Nothing is kept across turns here."""


async def test_scripted_tool_call_through_the_char_tokenizer_and_driver(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(save_char_tokenizer(tmp_path / "tok"))
    runner = ScriptedRunner(tokenizer, [CALL, ANSWER])
    prompt_ids = np.asarray(tokenizer.encode("Janet has 16 eggs..."), np.int32)
    prompt = Prompt(
        uid="p0",
        prompt_ids=TensorRef(dtype="int32", shape=(len(prompt_ids),), frame=0),
        n_samples=1,
        data_source="openai/gsm8k",
        ground_truth="18",
        prompt_text="Janet has 16 eggs...",
        max_new_tokens=256,
    )
    pool = EnvPool("gsm8k_python", workers=1, step_timeout_s=15.0)
    try:
        config = EnvironmentConfig(name="gsm8k_python", max_turns=3)
        driver = EpisodeDriver(runner, tokenizer, pool, config)
        assert driver.stop_ids == ()  # a turn ends at end-of-sequence
        sample, stats = await driver.run_episode(prompt, prompt_ids, 0)
    finally:
        pool.close()
    assert (sample.finish_reason, sample.score) == ("stop", 1.0)
    assert (stats.turns, stats.tool_calls, stats.tool_errors, stats.tool_used) == (2, 1, 0, 1)
    # the call reached the sandbox intact (no <unk> in its fence) and its output came back
    assert sample.response_text == CALL + OUTPUT + ANSWER
    assert stats.masked_tokens == len(OUTPUT) == int((sample.extra["loss_mask"] == 0).sum())


def _is_env_worker(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z" and b"pipeline.envs.worker" in cmdline
