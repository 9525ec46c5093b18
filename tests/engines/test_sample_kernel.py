"""The Triton sampler (engines/sample_kernel.py) against `sampling.sample` without top-k /
top-p: the same tokens (the same hashed Gumbel noise, ties to the lowest id) and the same
log-probs. On CPU under Triton's interpreter (a subprocess: TRITON_INTERPRET=1 must be set
before Triton compiles anything); compiled in bf16 on a GPU host (marked gpu)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from ..models.triton_helpers import HAS_TRITON, NO_TRITON, interpret, run_script

CHECK = """
import torch
from pipeline.engines import sample_kernel
from pipeline.engines.rng import GumbelNoise
from pipeline.engines.sampling import RowParams, sample

def case(rows, vocab, splits_target, greedy_every, ties):
    sample_kernel.TARGET_PROGRAMS = splits_target
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(DEVICE, DTYPE)
    if ties:  # equal maxima in several vocabulary splits: the lowest id wins, as torch.argmax
        logits[:, [5, vocab // 2, vocab - 1]] = 40.0
    temperature = torch.tensor([0.0 if i % greedy_every == 0 else 0.5 + 0.25 * (i % 4)
                                for i in range(rows)], device=DEVICE)
    keys = torch.randint(-2**31, 2**31 - 1, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    index = torch.randint(0, 4000, (rows,), generator=g).to(DEVICE)
    noise = GumbelNoise(vocab, DEVICE)
    params = RowParams(temperature, torch.ones(rows, device=DEVICE),
                       torch.zeros(rows, dtype=torch.long, device=DEVICE), keys, index)
    all_greedy = greedy_every == 1
    want_t, want_lp = sample(logits, params, noise, truncate=False, all_greedy=all_greedy)
    got_t, got_lp = sample_kernel.sample_rows(logits, temperature, keys, index,
                                              noise.vocab_hash, noise=not all_greedy)
    assert got_t.dtype == torch.int64 and got_lp.dtype == torch.float32
    same = (got_t == want_t).float().mean().item()
    assert same >= MIN_SAME, (rows, vocab, splits_target, same)
    agree = got_t == want_t
    err = (got_lp[agree] - want_lp[agree]).abs().max().item()
    assert err < ATOL, (rows, vocab, err)
    if ties:
        greedy = temperature <= 0
        assert (got_t[greedy] == 5).all()

for rows, vocab, target, greedy_every, ties in CASES:
    case(rows, vocab, target, greedy_every, ties)
print("sampler ok")
"""

# (rows, vocab, programs aimed at, every k-th row greedy, tied maxima)
CPU_CASES = [
    (5, 5003, 1024, 2, False),  # several splits a row, a vocabulary no multiple of BLOCK
    (5, 5003, 1, 3, False),  # one split a row
    (4, 4096, 1024, 1, True),  # all greedy (no noise drawn), ties across splits
    (6, 300, 1024, 2, True),  # a vocabulary under one BLOCK
]


def _script(device: str, dtype: str, atol: float, min_same: float, cases: list) -> str:
    prelude = (
        f"DEVICE, DTYPE, ATOL, MIN_SAME = {device!r}, torch.{dtype}, {atol}, {min_same}\n"
        f"CASES = {cases!r}\n"
    )
    return textwrap.dedent(CHECK).replace("import torch\n", "import torch\n" + prelude, 1)


@pytest.mark.skipif(not HAS_TRITON, reason=NO_TRITON)
def test_sampler_kernel_matches_the_torch_sampler_under_the_interpreter():
    # float32 on both sides: every token equal (a flip needs two noisy scores within 1e-6)
    assert "sampler ok" in interpret(_script("cpu", "float32", 1e-5, 1.0, CPU_CASES))


ENGINE_CHECK = """
import sys
sys.path.insert(0, "tests")
from pipeline.engines import GenerationRequest, SamplingParams, TorchEngine, TorchEngineConfig
from engines.helpers import assert_generations_match, make_model, prompts

def run(kernel):
    engine = TorchEngine(make_model(), TorchEngineConfig(max_batch=4, max_seq_len=64,
                                                         sample_kernel=kernel))
    assert engine.sample_kernel is kernel
    batch = prompts(3, [4, 9, 2], seed=5)
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3),
              SamplingParams(temperature=0.0, max_new_tokens=9),
              SamplingParams(temperature=0.7, max_new_tokens=10, seed=4)]
    return engine.generate([GenerationRequest(f"r{i}", p, s)
                            for i, (p, s) in enumerate(zip(batch, params))])

assert_generations_match(run(True), run(False), 1e-5)
print("engine ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason=NO_TRITON)
def test_engine_with_the_sampler_kernel_generates_what_the_torch_sampler_does():
    assert "engine ok" in interpret(textwrap.dedent(ENGINE_CHECK))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampler_kernel_matches_the_torch_sampler_in_bf16_on_cuda():
    # the GPU's fast log/exp differ from torch's in the last bits: a rare near-tie may flip
    cases = [(256, 151936, 1024, 4, False), (7, 151936, 1024, 1, True), (64, 32000, 1, 2, False)]
    assert "sampler ok" in run_script(_script("cuda", "bfloat16", 1e-4, 0.98, cases))
