"""The built-in engine on CUDA, eager and with captured decode graphs (GPU host only)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engines import (
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    TorchEngine,
    TorchEngineConfig,
)
from pipeline.models import load_model

from .helpers import assert_same_sample, perturbed_state, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 matmuls in full precision, so CPU and GPU logits agree to round-off."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _engine(model_dir, device: str, **options) -> TorchEngine:
    options.setdefault("max_seq_len", 128)
    return TorchEngine.from_pretrained(
        model_dir, device=device, config=TorchEngineConfig(**options)
    )


def _workload() -> list[GenerationRequest]:
    batch = prompts(7, [3, 11, 6, 1, 17, 8, 4], seed=3)
    settings = [
        SamplingParams(temperature=0.0, max_new_tokens=12),
        SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(7,)),
        SamplingParams(temperature=0.9, max_new_tokens=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=9, n=2, seed=2),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=15, seed=3),
        SamplingParams(temperature=0.0, max_new_tokens=3),
        SamplingParams(temperature=1.2, top_k=8, top_p=0.9, max_new_tokens=11, seed=4),
    ]
    return [
        GenerationRequest(f"r{i}", p, s)
        for i, (p, s) in enumerate(zip(batch, settings, strict=True))
    ]


def _run_with_update(engine: TorchEngine, state: dict[str, torch.Tensor]) -> list[GenerationOutput]:
    """The workload, with a weight update (version 1) after three steps; outputs sorted."""
    for request in _workload():
        engine.add_request(request)
    outs = [out for _ in range(3) for out in engine.step()]
    engine.update_weights(state.items(), version=1)  # graphs must see the new weights
    while engine.has_unfinished():
        outs.extend(engine.step())
    return sorted(outs, key=lambda o: (o.request_id, o.sample_index))


def test_cuda_engine_matches_cpu_engine_for_greedy_and_seeded_sampling(model_dir):
    cpu = _engine(model_dir, "cpu", max_batch=3).generate(_workload())
    gpu = _engine(model_dir, "cuda", max_batch=3).generate(_workload())
    for got, want in zip(gpu, cpu, strict=True):
        assert_same_sample(got, want, atol=1e-4)


def test_cuda_graph_decode_equals_eager_decode_across_buckets_and_a_weight_update(model_dir):
    native = load_model(model_dir)
    state = perturbed_state(native, seed=9)
    results = []
    for graphs in (False, True):
        engine = _engine(model_dir, "cuda", max_batch=5, use_cuda_graphs=graphs)
        results.append(_run_with_update(engine, state))
        if graphs:
            assert engine.graphs is not None and len(engine.graphs.graphs) >= 3
    eager, graphed = results
    assert any(1 in o.token_versions and 0 in o.token_versions for o in graphed)
    for got, want in zip(graphed, eager, strict=True):
        assert_same_sample(got, want, atol=1e-5)


def test_compiled_blocks_and_sampler_with_graphs_equal_eager_decode(model_dir):
    """engine.compile: blocks compiled around an eager attention, the sampler compiled,
    decode graphs captured over them: the same samples as the plain eager engine."""
    native = load_model(model_dir)
    state = perturbed_state(native, seed=9)
    results = []
    for fast in (False, True):
        engine = _engine(model_dir, "cuda", max_batch=5, use_cuda_graphs=fast, compile=fast)
        results.append(_run_with_update(engine, state))
    eager, fast = results
    for got, want in zip(fast, eager, strict=True):
        assert_same_sample(got, want, atol=1e-4)


def test_decode_kernel_in_bf16_generates_what_the_sdpa_path_does(model_dir):
    """The in-place Triton decode attention inside compiled blocks and CUDA graphs, across a
    weight update: the samples of the gather + SDPA path, up to bf16 round-off (a near-tie
    may flip a token, after which the two samples continue differently)."""
    state = perturbed_state(load_model(model_dir), seed=9)
    results = []
    for kernel in (False, True):
        model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
        config = TorchEngineConfig(
            max_batch=5, max_seq_len=128, use_cuda_graphs=True, compile=True, decode_kernel=kernel
        )
        engine = TorchEngine(model, config)
        assert engine.cache.decode_kernel is kernel and engine.overlap
        results.append(_run_with_update(engine, state))
    sdpa, kernel_outs = results
    identical = 0
    for got, want in zip(kernel_outs, sdpa, strict=True):
        same = 0
        while same < min(len(got.output_ids), len(want.output_ids)):
            if got.output_ids[same] != want.output_ids[same]:
                break
            same += 1
        # on the common prefix the log-probs agree to bf16 round-off
        diff = torch.tensor(got.logprobs[:same]) - torch.tensor(want.logprobs[:same])
        assert same == 0 or diff.abs().max().item() < 0.1, (got.request_id, diff)
        assert got.token_versions[:same] == want.token_versions[:same]
        identical += got.output_ids == want.output_ids
    assert identical >= len(sdpa) - 2, f"only {identical} of {len(sdpa)} samples identical"
