"""The prompts of a burst into an idle engine start together (the rollout service's
EngineRunner over the built-in engine, the char tokenizer)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
from pipeline.engines import TorchEngine, TorchEngineConfig
from pipeline.models import CausalLM
from pipeline.wire.messages import Prompt, TensorRef
from services.rollout.runner import EngineRunner
from tests.engines.helpers import TINY

NEW = 24
PROMPTS = 4


def _steps(tmp_path, **window: float) -> tuple[int, list[int]]:
    """Engine steps to answer PROMPTS prompts handed over 20 ms apart, and the lengths."""
    tokenizer = load_tokenizer(save_char_tokenizer(tmp_path))
    torch.manual_seed(0)
    model = CausalLM(TINY.replace(vocab_size=len(tokenizer))).eval()
    engine = TorchEngine(model, TorchEngineConfig(max_batch=16, max_seq_len=64, seed=0))

    async def main() -> list:
        runner = EngineRunner(engine, tokenizer, asyncio.get_running_loop(), **window)
        ref = TensorRef(dtype="int32", shape=(6,), frame=0)
        calls = []
        try:
            for k in range(PROMPTS):
                prompt = Prompt(
                    uid=f"p{k}", prompt_ids=ref, n_samples=2, max_new_tokens=NEW, ignore_eos=True
                )
                calls.append(asyncio.ensure_future(runner.generate(prompt, np.arange(k, k + 6))))
                await asyncio.sleep(0.02)
            return await asyncio.gather(*calls)
        finally:
            await runner.close()

    groups = asyncio.run(main())
    return engine._clock, [len(s.response_ids) for g in groups for s in g]


def test_a_burst_of_prompts_starts_in_one_step(tmp_path):
    # a window wider than the gaps: every prompt is admitted before the first step, so
    # the step that samples the first token and NEW - 1 decodes answer them all
    steps, lengths = _steps(tmp_path, burst_quiet_s=0.5, burst_max_s=5.0)
    assert lengths == [NEW] * PROMPTS * 2
    assert steps == NEW
    # no window: the engine starts on the first prompt and the others join later
    steps, lengths = _steps(tmp_path, burst_quiet_s=0.0, burst_max_s=0.0)
    assert lengths == [NEW] * PROMPTS * 2
    assert steps > NEW
