"""In-flight weight updates: applied between decode steps, recorded per token, or drained."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.engines import (
    EngineStateError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    TorchEngine,
    TorchEngineConfig,
    WeightUpdateError,
)
from pipeline.models import CausalLM, load_model

from .helpers import (
    TINY,
    full_forward_logprobs,
    greedy_reference,
    kv_cache_for,
    make_model,
    perturbed_state,
    prompts,
    tensor_bytes_held,
)

BEFORE = 4  # tokens each sample produces before the update lands
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.fixture
def policies(model_dir) -> tuple[CausalLM, CausalLM, dict[str, torch.Tensor]]:
    old = load_model(model_dir)
    assert isinstance(old, CausalLM)
    state = perturbed_state(old, seed=9)
    new = CausalLM(TINY).eval()
    new.load_state_dict(state)
    return old, new, state


def _run_with_update(engine, state, batch) -> list[GenerationOutput]:
    for i, p in enumerate(batch):
        engine.add_request(GenerationRequest(f"r{i}", p, GREEDY))
    for _ in range(BEFORE):
        assert engine.step() == []
    update = engine.update_weights(state.items(), version=1)
    assert engine.version == 0 and not update.done()  # offered: only step() applies it
    outs: list[GenerationOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
        assert engine.version == 1 and update.result(timeout=0) == 1
    return sorted(outs, key=lambda o: o.request_id)


def test_update_between_decode_steps_recomputes_kv_and_tags_tokens_with_both_versions(
    make_torch_engine, policies
):
    old, new, state = policies
    batch = prompts(3, [5, 9, 2], seed=3)
    outs = _run_with_update(make_torch_engine(max_batch=4), state, batch)
    changed = 0
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_versions == [0] * BEFORE + [1] * (MAX_NEW - BEFORE)
        assert out.output_ids[:BEFORE] == greedy_reference(old, prompt, BEFORE)
        # after the update each token is the new policy's greedy choice given the prefix
        prefix = prompt + out.output_ids[:BEFORE]
        assert out.output_ids[BEFORE:] == greedy_reference(new, prefix, MAX_NEW - BEFORE)
        logprobs = torch.tensor(out.logprobs)
        torch.testing.assert_close(
            logprobs[:BEFORE], full_forward_logprobs(old, out)[:BEFORE], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            logprobs[BEFORE:], full_forward_logprobs(new, out)[BEFORE:], atol=1e-4, rtol=0
        )
        changed += out.output_ids[BEFORE:] != greedy_reference(old, prefix, MAX_NEW - BEFORE)
    assert changed > 0  # the update changed what was generated


def _stale_kv_continuation(old: CausalLM, new: CausalLM, prompt: list[int], out: list[int]):
    """Greedy tokens when the new weights decode on top of keys/values the old ones cached."""
    cache = kv_cache_for(TINY, num_slots=1, max_seq_len=64)
    slot = torch.tensor([0])
    n = len(prompt)
    old.forward_cached(torch.tensor([prompt]), torch.arange(n)[None], slot, cache)
    for i in range(BEFORE - 1):  # old weights fed tokens 0..BEFORE-2
        old.forward_cached(torch.tensor([[out[i]]]), torch.tensor([[n + i]]), slot, cache)
    predicted = []
    for i in range(BEFORE - 1, len(out) - 1):
        logits = new.forward_cached(torch.tensor([[out[i]]]), torch.tensor([[n + i]]), slot, cache)
        predicted.append(int(logits[0, 0].argmax()))
    return predicted


def test_update_with_kept_kv_continues_on_the_old_cache_with_new_weights(
    make_torch_engine, policies
):
    old, new, state = policies
    batch = prompts(3, [5, 9, 2], seed=3)
    outs = _run_with_update(make_torch_engine(max_batch=4, kv_on_update="keep"), state, batch)
    differs = 0
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_versions == [0] * BEFORE + [1] * (MAX_NEW - BEFORE)
        assert out.output_ids[:BEFORE] == greedy_reference(old, prompt, BEFORE)
        expected = _stale_kv_continuation(old, new, prompt, out.output_ids)
        assert out.output_ids[BEFORE:] == expected
        prefix = prompt + out.output_ids[:BEFORE]
        differs += expected != greedy_reference(new, prefix, MAX_NEW - BEFORE)
    assert differs > 0  # stale keys/values made a difference, so the check can tell


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: {**s, "model.bogus.weight": torch.zeros(2)}, "unknown: model.bogus.weight"),
        (lambda s: {k: v for k, v in s.items() if k != "model.norm.weight"}, "missing"),
        (lambda s: {**s, "model.norm.weight": torch.zeros(3)}, "mis-shaped"),
    ],
    ids=["unknown_name", "missing_name", "wrong_shape"],
)
def test_invalid_update_is_refused_and_the_old_weights_keep_serving(
    make_torch_engine, policies, edit, message
):
    old, _, state = policies
    engine = make_torch_engine(max_batch=2)
    with pytest.raises(WeightUpdateError, match=message):
        engine.update_weights(edit(state).items(), version=1)
    prompt = prompts(1, [4])[0]
    (out,) = engine.generate([GenerationRequest("r", prompt, GREEDY)])
    assert engine.version == 0
    assert out.output_ids == greedy_reference(old, prompt, MAX_NEW)


def test_update_to_an_older_version_is_refused(make_torch_engine, policies):
    _, _, state = policies
    engine = make_torch_engine(max_batch=2)
    engine.update_weights(state.items(), version=3)
    engine.step()
    assert engine.version == 3
    with pytest.raises(WeightUpdateError, match="stale version"):
        engine.update_weights(state.items(), version=2)


def test_paused_engine_applies_staged_weights_but_generates_nothing(make_torch_engine, policies):
    _, new, state = policies
    engine = make_torch_engine(max_batch=2)
    prompt = prompts(1, [6], seed=12)[0]
    engine.pause()
    engine.add_request(GenerationRequest("r", prompt, GREEDY))
    engine.update_weights(state.items(), version=1)
    assert engine.step() == []
    assert engine.version == 1 and len(engine._waiting) == 1
    with pytest.raises(EngineStateError, match="paused"):
        engine.generate([])
    engine.resume()
    outs: list[GenerationOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[0].output_ids == greedy_reference(new, prompt, MAX_NEW)
    assert outs[0].token_versions == [1] * MAX_NEW


def test_tied_embedding_model_accepts_updates_with_or_without_lm_head():
    model = make_model(TINY.replace(tie_word_embeddings=True))
    engine = TorchEngine(model, TorchEngineConfig(max_batch=2, max_seq_len=32))
    state = perturbed_state(model, seed=1)
    assert "lm_head.weight" in state
    engine.update_weights(state.items(), version=1)
    without_head = {k: v for k, v in state.items() if k != "lm_head.weight"}
    engine.update_weights(without_head.items(), version=2)
    engine.step()
    assert engine.version == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, state["model.embed_tokens.weight"])
    reference = make_model(TINY.replace(tie_word_embeddings=True))
    reference.load_state_dict(without_head, strict=False)
    prompt = prompts(1, [5])[0]
    (out,) = engine.generate([GenerationRequest("r", prompt, GREEDY)])
    assert out.output_ids == greedy_reference(reference, prompt, MAX_NEW)
    assert out.token_versions == [2] * MAX_NEW


def test_update_staged_from_another_thread_lands_whole_between_two_steps(
    make_torch_engine, policies
):
    _, _, state = policies
    engine = make_torch_engine(max_batch=4)
    for i, p in enumerate(prompts(3, [5, 9, 2], seed=3)):
        engine.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=20)))
    outs: list[GenerationOutput] = []
    receiver = threading.Thread(target=engine.update_weights, args=(state.items(), 1))
    for step in range(20 + 2 * engine.overlap):  # outputs come two steps late with overlap
        if step == 3:
            receiver.start()  # stages while this thread keeps decoding
        if step == 10:
            receiver.join()  # at the latest, the update lands at step 10
        outs.extend(engine.step())
    assert engine.version == 1 and not engine.has_unfinished()
    switch = {o.token_versions.index(1) for o in outs}
    assert len(switch) == 1  # every sample switched at the same step
    (at,) = switch
    assert all(o.token_versions == [0] * at + [1] * (20 - at) for o in outs)


def test_update_is_copied_only_into_the_live_weights_and_resolves_once_they_serve(
    make_torch_engine, policies
):
    _, new, state = policies
    engine = make_torch_engine(max_batch=2)
    live = list(engine.model.parameters())
    update = engine.update_weights(state.items(), version=1)
    # parked until the safe point: the engine refers to the caller's tensors, copies nothing
    assert tensor_bytes_held(engine.weights, besides=[*live, *state.values()]) == 0
    assert not update.done() and engine.version == 0
    engine.step()
    assert update.result(timeout=0) == 1 and engine.version == 1
    for name, param in engine.model.state_dict().items():
        assert torch.equal(param, state[name]), name
    assert tensor_bytes_held(engine.weights, besides=live) == 0  # nothing kept between syncs
    prompt = prompts(1, [5], seed=2)[0]
    (out,) = engine.generate([GenerationRequest("r", prompt, GREEDY)])
    assert out.output_ids == greedy_reference(new, prompt, MAX_NEW)
    assert out.token_versions == [1] * MAX_NEW


def test_withdrawn_update_is_never_applied(make_torch_engine, policies):
    old, _, state = policies
    engine = make_torch_engine(max_batch=2)
    prompt = prompts(1, [5], seed=2)[0]
    engine.add_request(GenerationRequest("r", prompt, GREEDY))
    engine.step()
    update = engine.update_weights(state.items(), version=1)
    assert update.cancel()  # as the receiver does when its apply deadline passes
    outs: list[GenerationOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert engine.version == 0 and update.cancelled()
    assert outs[0].output_ids == greedy_reference(old, prompt, MAX_NEW)
    assert outs[0].token_versions == [0] * MAX_NEW
    engine.update_weights(state.items(), version=1)  # the same version may come again
    engine.step()
    assert engine.version == 1


def test_newer_update_withdraws_an_older_one_not_yet_applied(make_torch_engine, policies):
    old, _, state = policies
    engine = make_torch_engine(max_batch=2)
    first = engine.update_weights(state.items(), version=1)
    second = engine.update_weights(old.state_dict().items(), version=2)
    assert first.cancelled() and not second.done()
    engine.step()
    assert second.result(timeout=0) == 2 and engine.version == 2
    for name, param in engine.model.state_dict().items():
        assert torch.equal(param, old.state_dict()[name]), name
