"""Request validation, n samples, seeding, pause/resume and the factory."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.engines import (
    BackendUnavailableError,
    EngineStateError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TorchEngine,
    TorchEngineConfig,
    make_engine,
)
from pipeline.errors import ConfigError, PipelineError

from .helpers import assert_same_sample, prompts

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_new_tokens": 0},
        {"n": 0},
        {"stop_token_ids": (-3,)},
    ],
)
def test_invalid_sampling_params_raise_typed_error(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
    assert issubclass(InvalidRequestError, PipelineError)


def test_bad_requests_are_refused_with_the_reason(make_torch_engine):
    engine = make_torch_engine(max_batch=2, max_seq_len=8)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        GenerationRequest("e", [])
    with pytest.raises(InvalidRequestError, match="exceeds max_seq_len=8"):
        engine.add_request(GenerationRequest("long", list(range(9))))
    with pytest.raises(InvalidRequestError, match="must lie in"):
        engine.add_request(GenerationRequest("oov", [1, 96]))
    engine.add_request(GenerationRequest("dup", [1, 2]))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request(GenerationRequest("dup", [3]))
    with pytest.raises(EngineStateError, match="idle engine"):
        engine.generate([GenerationRequest("x", [1])])
    with pytest.raises(ConfigError):
        TorchEngineConfig(kv_on_update="discard")  # type: ignore[arg-type]


def test_n_samples_share_the_prompt_and_come_back_ordered_by_sample_index(make_torch_engine):
    engine = make_torch_engine(max_batch=3)
    prompt = prompts(1, [5])[0]
    outs = engine.generate(
        [
            GenerationRequest("a", prompt, SamplingParams(max_new_tokens=6, n=4, seed=7)),
            GenerationRequest("b", prompt, SamplingParams(temperature=0.0, max_new_tokens=3)),
        ]
    )
    assert [(o.request_id, o.sample_index) for o in outs] == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("b", 0),
    ]
    assert all(o.prompt_ids == prompt for o in outs)
    assert len({tuple(o.output_ids) for o in outs[:4]}) > 1  # independent draws


def test_seeded_samples_do_not_depend_on_batch_composition_or_slot(make_torch_engine):
    prompt = prompts(1, [6], seed=3)[0]
    seeded = GenerationRequest("s", prompt, SamplingParams(max_new_tokens=10, n=3, seed=42))
    alone = make_torch_engine(max_batch=1).generate([seeded])
    busy = make_torch_engine(max_batch=5, seed=99)
    others = [
        GenerationRequest(f"o{i}", p, SamplingParams(temperature=0.8, max_new_tokens=7))
        for i, p in enumerate(prompts(4, [3, 9], seed=4))
    ]
    for request in others[:2]:
        busy.add_request(request)
    busy.step()
    busy.step()  # the seeded request joins mid-run, in other slots, at other steps
    busy.add_request(seeded)
    for request in others[2:]:
        busy.add_request(request)
    mixed = []
    while busy.has_unfinished():
        mixed.extend(o for o in busy.step() if o.request_id == "s")
    mixed.sort(key=lambda o: o.sample_index)
    for got, want in zip(mixed, alone, strict=True):
        assert_same_sample(got, want)


def test_unseeded_requests_are_reproducible_from_the_engine_seed(make_torch_engine):
    requests = [
        GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, n=2))
        for i, p in enumerate(prompts(3, [4, 7]))
    ]
    first = make_torch_engine(max_batch=4, seed=5).generate(requests)
    again = make_torch_engine(max_batch=2, seed=5).generate(requests)
    other = make_torch_engine(max_batch=4, seed=6).generate(requests)
    for got, want in zip(again, first, strict=True):
        assert_same_sample(got, want)
    assert [o.output_ids for o in other] != [o.output_ids for o in first]


def test_greedy_and_sampled_rows_mix_in_one_batch(make_torch_engine):
    prompt = prompts(1, [5], seed=9)[0]
    greedy = GenerationRequest("g", prompt, SamplingParams(temperature=0.0, max_new_tokens=8))
    (solo,) = make_torch_engine(max_batch=1).generate([greedy])
    outs = make_torch_engine(max_batch=4).generate(
        [
            GenerationRequest("t", prompt, SamplingParams(temperature=1.5, top_k=3, n=2)),
            greedy,
            GenerationRequest("p", prompt, SamplingParams(temperature=0.5, top_p=0.5)),
        ]
    )
    assert_same_sample(next(o for o in outs if o.request_id == "g"), solo)


def test_factory_builds_the_torch_engine_and_refuses_unknown_kinds(model_dir):
    engine = make_engine("torch", model_dir, max_batch=2, max_seq_len=32, kv_on_update="keep")
    assert isinstance(engine, TorchEngine)
    assert engine.config.kv_on_update == "keep" and engine.config.max_batch == 2
    with pytest.raises(ConfigError, match="unknown"):
        make_engine("tgi", model_dir)  # type: ignore[arg-type]


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed; this checks the error without it")
def test_vllm_backend_imports_without_vllm_and_raises_a_typed_error(model_dir):
    from pipeline.engines import vllm_engine

    with pytest.raises(BackendUnavailableError, match="pip install"):
        vllm_engine.VLLMEngine(model_dir)
    with pytest.raises(BackendUnavailableError):
        make_engine("vllm", model_dir)
