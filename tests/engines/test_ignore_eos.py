"""A dataset row's `ignore_eos`: the end-of-sequence token ends none of that prompt's
samples, their budget does. The row's flag goes through the loader, the controller (and its
journal) and the Prompt message to the rollout service's EngineRunner, which leaves EOS out
of that prompt's stop tokens (the built-in engine here, the char tokenizer), beside a prompt
of a row without it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import PipelineConfig
from pipeline.data.cursor import PromptCursor
from pipeline.data.loader import load_prompts
from pipeline.data.records import BadRowError
from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
from pipeline.engines import TorchEngine, TorchEngineConfig
from pipeline.models import CausalLM
from pipeline.runtime.journal import RunState
from pipeline.wire.messages import Prompt, TensorRef
from services.controller.service import Controller
from services.rollout.runner import EngineRunner
from tests.engines.helpers import TINY
from tests.runtime.budget_rows import budget_rows

NEW = 48


def test_a_row_may_say_ignore_eos_and_a_bad_value_names_the_row(tmp_path):
    path = budget_rows(tmp_path / "ok.jsonl", [None] * 3, ignore_eos=[True, None, False])
    assert [r.ignore_eos for r in load_prompts(path)] == [True, False, False]
    for bad in ("true", 1, 0):
        path = budget_rows(tmp_path / "bad.jsonl", [None] * 2, ignore_eos=[True, bad])
        with pytest.raises(BadRowError, match=r"row 1.*ignore_eos"):
            load_prompts(path)


def _prompts(tmp_path) -> dict[str, Prompt]:
    """The Prompt messages the controller sends for a row with ignore_eos (r0) and one
    without (r1), by row; a restarted controller reads the same back from its journal."""
    data = budget_rows(tmp_path / "data.jsonl", [None, None], ignore_eos=[True, None])
    base = PipelineConfig()
    config = dataclasses.replace(
        base, rollout=dataclasses.replace(base.rollout, max_new_tokens=NEW)
    )
    controller = Controller(config, tmp_path / "run")
    controller._tokenizer = load_tokenizer(save_char_tokenizer(tmp_path / "tok"))
    controller._cursor = PromptCursor(load_prompts(data), seed=0)
    released = [controller.next_release(i) for i in range(2)]
    state = RunState()
    record = {"kind": "release", "prompts": [dataclasses.asdict(p) for p in released]}
    state.apply(json.loads(json.dumps(record)))
    assert state.released == released
    return {p.uid.split(":")[1]: controller.encode(p)[0] for p in released}


def _generate(tokenizer, prompts: list[Prompt]) -> list[list]:
    torch.manual_seed(0)
    model = CausalLM(TINY.replace(vocab_size=len(tokenizer))).eval()
    model.init_weights(std=0.02)  # near-uniform next tokens: EOS comes up within a few dozen
    engine = TorchEngine(model, TorchEngineConfig(max_batch=32, max_seq_len=64, seed=0))

    async def main() -> list:
        runner = EngineRunner(engine, tokenizer, asyncio.get_running_loop())
        try:
            ids = np.arange(4, 12, dtype=np.int32)
            return await asyncio.gather(*(runner.generate(p, ids) for p in prompts))
        finally:
            await runner.close()

    return asyncio.run(main())


def test_a_rows_ignore_eos_runs_its_samples_to_the_limit_and_no_other_rows(tmp_path):
    prompts = _prompts(tmp_path)
    ignoring, plain = prompts["r0"], prompts["r1"]
    assert ignoring.ignore_eos and not plain.ignore_eos
    assert ignoring.max_new_tokens == plain.max_new_tokens == NEW
    ref = TensorRef(dtype="int32", shape=(8,), frame=0)
    # the same 8-token prompt for both, 16 samples each, in one engine at once
    ignoring = msgspec.structs.replace(ignoring, prompt_ids=ref, n_samples=16)
    plain = msgspec.structs.replace(plain, prompt_ids=ref, n_samples=16)
    tokenizer = load_tokenizer(tmp_path / "tok")
    kept, stopped = _generate(tokenizer, [ignoring, plain])
    assert [len(s.response_ids) for s in kept] == [NEW] * 16
    assert {s.finish_reason for s in kept} == {"length"}
    lengths = [len(s.response_ids) for s in stopped]
    assert min(lengths) < NEW and "stop" in {s.finish_reason for s in stopped}  # EOS ended some
