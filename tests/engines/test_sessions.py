"""Multi-turn sessions of the built-in engine: a finished turn's KV cache kept for the next.

Each test plays an episode's two turns by hand: the first turn's request, then one that
continues its sequence with "environment" tokens appended, in the same session. The second
turn must prefill only the tokens past the kept prefix, and give what a full prefill gives.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engines import GenerationRequest, SamplingParams
from pipeline.engines.errors import InvalidRequestError

from .helpers import perturbed_state, prompts

ENV = [5, 6, 7]  # the environment's tokens between the turns


def turn(engine, rid: str, prompt: list[int], session: str | None, *, seed: int = 3, n: int = 6):
    params = SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed)
    (out,) = engine.generate([GenerationRequest(rid, prompt, params, session)])
    return out


def second_prompt(out) -> list[int]:
    return [*out.prompt_ids, *out.output_ids, *ENV]


def test_the_second_turn_prefills_only_the_new_tokens(make_torch_engine) -> None:
    engine = make_torch_engine(max_batch=4)
    (prompt,) = prompts(1, [9])
    first = turn(engine, "t0", prompt, "ep")
    assert first.cached_tokens == 0 and len(engine.sessions) == 1
    nxt = second_prompt(first)
    rows = engine.prefill_rows
    second = turn(engine, "t1", nxt, "ep", seed=4)
    # everything but the last sampled token was cached: it and the environment's are new
    assert second.cached_tokens == len(nxt) - len(ENV) - 1
    assert engine.prefill_rows == rows + 1
    # the same tokens and log-probs as a fresh engine prefilling the whole sequence
    fresh = turn(make_torch_engine(max_batch=4), "f", nxt, None, seed=4)
    assert second.output_ids == fresh.output_ids
    torch.testing.assert_close(second.logprobs, fresh.logprobs, atol=1e-5, rtol=0)
    assert fresh.cached_tokens == 0
    engine.release("ep")
    assert len(engine.sessions) == 0


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_weight_update_between_turns(make_torch_engine, kv: str) -> None:
    """recompute: the next turn prefills the whole sequence under the new weights; keep: it
    reuses the old weights' cache. Either way its tokens carry the new version."""
    engine = make_torch_engine(max_batch=4, kv_on_update=kv)
    (prompt,) = prompts(1, [9])
    first = turn(engine, "t0", prompt, "ep")
    new = perturbed_state(engine.model, seed=7)
    future = engine.update_weights(new.items(), 1)
    engine.step()  # applied at the next step, with nothing running
    assert future.result(timeout=0) == 1
    nxt = second_prompt(first)
    second = turn(engine, "t1", nxt, "ep", seed=4)
    assert set(second.token_versions) == {1}
    fresh = make_torch_engine(max_batch=4)
    fresh.update_weights(new.items(), 1)
    full = turn(fresh, "f", nxt, None, seed=4)
    if kv == "recompute":
        assert second.cached_tokens == 0
        torch.testing.assert_close(second.logprobs, full.logprobs, atol=1e-5, rtol=0)
    else:
        assert second.cached_tokens == len(nxt) - len(ENV) - 1
        assert max(abs(a - b) for a, b in zip(second.logprobs, full.logprobs, strict=True)) > 1e-3


def test_a_kept_cache_is_evicted_when_slots_run_out(make_torch_engine) -> None:
    engine = make_torch_engine(max_batch=2)
    a, b, c = prompts(3, [8, 9, 10])
    first = turn(engine, "a0", a, "a")
    turn(engine, "b0", b, "b")  # both slots now kept
    assert len(engine.sessions) == 2
    turn(engine, "c0", c, None)  # needs a slot: the least recently kept (a) goes
    assert engine.sessions.evictions == 1 and len(engine.sessions) == 1
    again = turn(engine, "a1", second_prompt(first), "a")
    assert (again.cached_tokens, again.kv_evicted) == (0, True)
    kept_b = engine.sessions.peek("b")
    assert kept_b is not None  # b kept its slot: a found a free one (c's)


def test_release_frees_the_slot(make_torch_engine) -> None:
    engine = make_torch_engine(max_batch=1)
    a, b = prompts(2, [8, 9])
    turn(engine, "a0", a, "a")
    engine.release("a")
    turn(engine, "b0", b, None)
    assert engine.sessions.evictions == 0


def test_a_session_runs_one_request_at_a_time(make_torch_engine) -> None:
    engine = make_torch_engine(max_batch=4)
    (prompt,) = prompts(1, [8])
    engine.add_request(GenerationRequest("r0", prompt, SamplingParams(), "ep"))
    with pytest.raises(InvalidRequestError, match="has a request in flight"):
        engine.add_request(GenerationRequest("r1", prompt, SamplingParams(), "ep"))
    with pytest.raises(InvalidRequestError, match="n must be 1"):
        GenerationRequest("r2", prompt, SamplingParams(n=2), "other")


def test_first_turns_of_one_prompt_share_its_prefill(make_torch_engine) -> None:
    """A group's episodes are requests of their own; admitted together, their first turns
    prefill the shared prompt once, and sample as if each had prefilled it."""
    (prompt,) = prompts(1, [9])
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=s) for s in (1, 2)]
    shared = make_torch_engine(max_batch=4)
    outs = shared.generate(
        [GenerationRequest(f"e{i}", prompt, p, f"ep{i}") for i, p in enumerate(params)]
    )
    assert shared.prefill_rows == 1
    assert sorted(o.cached_tokens for o in outs) == [0, len(prompt)]
    alone = make_torch_engine(max_batch=4)
    for out, p in zip(outs, params, strict=True):
        (ref,) = alone.generate([GenerationRequest("r", prompt, p)])
        assert out.output_ids == ref.output_ids
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_identical_continuations_share_their_prefill_where_caches_hold_one_version(
    make_torch_engine, kv: str
) -> None:
    """Two episodes of one prompt that sampled the same turn and got the same environment
    tokens continue identical sequences: one prefill serves both, unless kept caches may
    hold different versions' keys (kv_on_update keep)."""
    (prompt,) = prompts(1, [9])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    engine = make_torch_engine(max_batch=4, kv_on_update=kv)
    first = engine.generate([GenerationRequest(f"e{i}", prompt, greedy, f"ep{i}") for i in (0, 1)])
    assert first[0].output_ids == first[1].output_ids
    rows = engine.prefill_rows
    nxt = second_prompt(first[0])
    second = engine.generate([GenerationRequest(f"e{i}t1", nxt, greedy, f"ep{i}") for i in (0, 1)])
    shared = kv == "recompute"
    assert engine.prefill_rows == rows + (1 if shared else 2)
    kept = len(nxt) - len(ENV) - 1
    assert sorted(o.cached_tokens for o in second) == ([kept, len(nxt)] if shared else [kept] * 2)
    (fresh,) = make_torch_engine(max_batch=4).generate([GenerationRequest("f", nxt, greedy)])
    for out in second:
        assert out.output_ids == fresh.output_ids  # greedy: the same continuation
        torch.testing.assert_close(out.logprobs, fresh.logprobs, atol=1e-5, rtol=0)


def test_a_changed_history_reuses_only_the_common_prefix(make_torch_engine) -> None:
    engine = make_torch_engine(max_batch=4)
    (prompt,) = prompts(1, [9])
    first = turn(engine, "t0", prompt, "ep")
    changed = [*first.prompt_ids[:4], (first.prompt_ids[4] + 1) % 96, *first.prompt_ids[5:]]
    second = turn(engine, "t1", [*changed, *first.output_ids, *ENV], "ep", seed=4)
    assert second.cached_tokens == 4
