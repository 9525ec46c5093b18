"""The in-place decode-attention kernel against a float64 reference and inside the engine.

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1, which must be set before
Triton compiles anything, hence a subprocess); skipped where Triton is not installed. The
same checks run compiled on a GPU host (tests marked gpu).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from .triton_helpers import HAS_TRITON, NO_TRITON, interpret, run_script

KERNEL_CHECK = """
import math, torch
from pipeline.models.decode_attention import decode_attention, decode_kernel_supported

def reference(q, k, v, slots, lengths):
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for i, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        if n == 0:
            continue
        kk = k[slot, :n].double().repeat_interleave(group, dim=1)  # (n, heads, d)
        vv = v[slot, :n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) / math.sqrt(q.shape[-1])
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    return out

def check(device, dtype, heads, kv_heads, d, atol):
    g = torch.Generator().manual_seed(heads * 100 + d)
    k = torch.randn(6, 400, kv_heads, d, generator=g).to(device, dtype)
    v = torch.randn(6, 400, kv_heads, d, generator=g).to(device, dtype)
    q = torch.randn(5, heads, d, generator=g).to(device, dtype)
    slots = torch.tensor([3, 0, 5, 1, 2], device=device)
    # empty row, one column, a chunk boundary (128), past two chunks, the whole bucket
    lengths = torch.tensor([0, 1, 128, 257, 384], device=device)
    assert decode_kernel_supported(k, heads)
    out = decode_attention(q, k, v, slots, lengths, 384)
    assert out.dtype == dtype and out.shape == q.shape
    want = reference(q.cpu(), k.cpu(), v.cpu(), slots.cpu(), lengths.cpu())
    err = (out.cpu().double() - want).abs().max().item()
    assert err < atol, (heads, kv_heads, d, err)
    assert out[0].abs().max().item() == 0.0  # an empty row reads nothing
    # with this step's keys and values: written at position length - 1 by the kernel (not
    # by an empty row), attended to as if the cache had held them already
    k_new = torch.randn(5, kv_heads, d, generator=g).to(device, dtype)
    v_new = torch.randn(5, kv_heads, 2 * d, generator=g).to(device, dtype)[..., :d]  # strided
    k_want, v_want = k.clone(), v.clone()
    for i, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        if n:
            k_want[slot, n - 1], v_want[slot, n - 1] = k_new[i], v_new[i]
    k[slots, (lengths - 1).clamp(min=0)] = 7.0  # stale values at the written positions
    v[slots, (lengths - 1).clamp(min=0)] = 7.0
    k_want[slots[0], 0], v_want[slots[0], 0] = 7.0, 7.0  # the empty row's slot stays as it was
    out = decode_attention(q, k, v, slots, lengths, 384, new=(k_new, v_new))
    want = reference(q.cpu(), k_want.cpu(), v_want.cpu(), slots.cpu(), lengths.cpu())
    err = (out.cpu().double() - want).abs().max().item()
    assert err < atol, ("write", heads, kv_heads, d, err)
    assert torch.equal(k, k_want) and torch.equal(v, v_want)

for heads, kv_heads, d in [(14, 2, 64), (4, 4, 16), (8, 2, 32)]:
    check(DEVICE, DTYPE, heads, kv_heads, d, ATOL)
print("kernel ok")
"""

ENGINE_CHECK = """
import sys
sys.path.insert(0, "tests")
from pipeline.engines import GenerationRequest, SamplingParams, TorchEngine, TorchEngineConfig
from engines.helpers import assert_generations_match, make_model, prompts

def run(decode_kernel):
    engine = TorchEngine(
        make_model(),
        TorchEngineConfig(max_batch=3, max_seq_len=160, overlap=True, decode_kernel=decode_kernel,
                          sample_kernel=False),  # the sampler has its own check
    )
    assert engine.cache.decode_kernel is decode_kernel
    batch = prompts(5, [4, 9, 2, 7, 12], seed=5)
    params = [SamplingParams(temperature=0.0, max_new_tokens=m) for m in (6, 140, 3, 9, 5)]
    params[1] = SamplingParams(temperature=1.0, max_new_tokens=140, seed=9)
    return engine.generate(
        [GenerationRequest(f"r{i}", p, s) for i, (p, s) in enumerate(zip(batch, params))]
    )

assert_generations_match(run(True), run(False), 1e-4)
print("engine ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason=NO_TRITON)
def test_kernel_matches_float64_attention_under_the_triton_interpreter():
    prelude = "DEVICE, DTYPE, ATOL = 'cpu', torch.float32, 1e-4\n"
    script = KERNEL_CHECK.replace("import math, torch\n", "import math, torch\n" + prelude)
    assert "kernel ok" in interpret(script)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason=NO_TRITON)
def test_engine_with_the_kernel_generates_what_the_sdpa_path_does_under_the_interpreter():
    # continuous batching with overlap: finished rows stay in the batch with length 0
    assert "engine ok" in interpret(textwrap.dedent(ENGINE_CHECK))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_float64_attention_in_bf16_on_cuda():
    prelude = "DEVICE, DTYPE, ATOL = 'cuda', torch.bfloat16, 3e-2\n"
    script = KERNEL_CHECK.replace("import math, torch\n", "import math, torch\n" + prelude)
    assert "kernel ok" in run_script(script)
