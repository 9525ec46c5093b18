"""The transformers reference backend agrees with the built-in engine under one interface."""

from __future__ import annotations

import pytest
import torch

from pipeline.engines import GenerationRequest, SamplingParams, make_engine
from pipeline.engines.hf_engine import HFEngine, HFEngineConfig
from pipeline.models import CausalLM, load_model

from .helpers import (
    TINY,
    full_forward_logprobs,
    greedy_reference,
    perturbed_state,
    prompts,
    tensor_bytes_held,
)

LENGTHS = [3, 11, 6, 1]


@pytest.fixture(scope="module")
def hf_engine(model_dir) -> HFEngine:
    return HFEngine(model_dir, config=HFEngineConfig(max_batch=8))


def test_hf_engine_greedy_equals_torch_engine_on_left_padded_batch(hf_engine, make_torch_engine):
    requests = [
        GenerationRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_new_tokens=10))
        for i, p in enumerate(prompts(4, LENGTHS, seed=2))
    ]
    ours = make_torch_engine(max_batch=4).generate(requests)
    theirs = hf_engine.generate(requests)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.request_id, a.output_ids, a.finish_reason) == (
            b.request_id,
            b.output_ids,
            b.finish_reason,
        )
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


def test_hf_engine_sampled_logprobs_are_the_full_tempered_distribution(hf_engine, model_dir):
    native = load_model(model_dir)
    assert isinstance(native, CausalLM)
    params = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=8, n=3, seed=4)
    outs = hf_engine.generate([GenerationRequest("s", prompts(1, [7])[0], params)])
    assert len(outs) == 3
    for out in outs:
        expected = full_forward_logprobs(native, out, temperature=0.8)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_hf_engine_stops_per_row_and_applies_updates_between_generate_calls(model_dir):
    engine = make_engine("hf", model_dir, max_batch=4)
    native = load_model(model_dir)
    assert isinstance(native, CausalLM)
    prompt_a, prompt_b = prompts(2, [4, 8], seed=6)
    stop = greedy_reference(native, prompt_a, 3)[2]
    stopping = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    out_a, out_b = engine.generate(
        [GenerationRequest("a", prompt_a, stopping), GenerationRequest("b", prompt_b, stopping)]
    )
    assert out_a.finish_reason == "stop" and out_a.output_ids[-1] == stop
    assert len(out_a.output_ids) <= 3
    full_b = greedy_reference(native, prompt_b, 8)
    end_b = full_b.index(stop) + 1 if stop in full_b else 8
    assert out_b.output_ids == full_b[:end_b]

    state = perturbed_state(native, seed=9)
    update = engine.update_weights(state.items(), version=1)
    live = engine.model.state_dict().values()
    assert tensor_bytes_held(engine.weights, besides=[*live, *state.values()]) == 0  # no copy
    new = CausalLM(TINY).eval()
    new.load_state_dict(state)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    (out,) = engine.generate([GenerationRequest("c", prompt_a, greedy)])
    assert engine.version == 1 and update.result(timeout=0) == 1
    assert out.token_versions == [1] * 6
    assert out.output_ids == greedy_reference(new, prompt_a, 6)


def test_hf_engine_static_cache_gives_the_same_greedy_tokens(hf_engine, model_dir):
    static = HFEngine(model_dir, config=HFEngineConfig(max_batch=8, static_cache=True))
    requests = [
        GenerationRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_new_tokens=6))
        for i, p in enumerate(prompts(3, LENGTHS, seed=8))
    ]
    for a, b in zip(static.generate(requests), hf_engine.generate(requests), strict=True):
        assert a.output_ids == b.output_ids
