"""`rollout.ignore_eos`: the end-of-sequence token ends no sample, the response limit does
(the rollout service's EngineRunner over the built-in engine, the char tokenizer)."""

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

NEW = 48


def _lengths(tokenizer, ignore_eos: bool) -> tuple[list[int], set[str]]:
    torch.manual_seed(0)
    model = CausalLM(TINY.replace(vocab_size=len(tokenizer))).eval()
    model.init_weights(std=0.02)  # near-uniform next tokens: EOS comes up within a few dozen
    engine = TorchEngine(model, TorchEngineConfig(max_batch=16, max_seq_len=64, seed=0))

    async def main() -> list:
        runner = EngineRunner(engine, tokenizer, asyncio.get_running_loop(), ignore_eos=ignore_eos)
        try:
            ids = np.arange(4, 12, dtype=np.int32)
            ref = TensorRef(dtype="int32", shape=(8,), frame=0)
            prompt = Prompt(uid="p", prompt_ids=ref, n_samples=16, max_new_tokens=NEW)
            return await runner.generate(prompt, ids)
        finally:
            await runner.close()

    samples = asyncio.run(main())
    return [len(s.response_ids) for s in samples], {s.finish_reason for s in samples}


def test_ignore_eos_runs_every_sample_to_the_limit(tmp_path):
    tokenizer = load_tokenizer(save_char_tokenizer(tmp_path))
    lengths, reasons = _lengths(tokenizer, ignore_eos=False)
    assert min(lengths) < NEW and "stop" in reasons  # EOS ended some samples
    lengths, reasons = _lengths(tokenizer, ignore_eos=True)
    assert lengths == [NEW] * 16 and reasons == {"length"}
