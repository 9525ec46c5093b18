"""EpisodeDriver on the real stack: the rollout service's EngineRunner over the built-in torch
engine, the char tokenizer, and environments in real worker processes.

The model is a bigram table made of transformer weights: one-hot embeddings, every layer's
output projections zero (the residual stream stays the current token's embedding, though
attention and the KV cache run), and an lm_head whose column for a token holds the logits
of the next. Greedy decoding then writes exactly the turns a test scripts:
"b" -> "?" (the lookup tool's call, a stop string), "=" -> "482", then end-of-sequence.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config.schema import EnvironmentConfig
from pipeline.data.tokenizer import EOS, load_tokenizer, save_char_tokenizer
from pipeline.engines import TorchEngine, TorchEngineConfig
from pipeline.envs.episode import EpisodeDriver, stop_token_ids
from pipeline.envs.pool import EnvPool
from pipeline.errors import ConfigError
from pipeline.models import CausalLM
from pipeline.wire.messages import Prompt, TensorRef
from services.rollout.runner import EngineRunner
from tests.engines.helpers import TINY

HIDDEN = 128
GAP = 6.0  # the scripted token's logit over every other's: log-probs clearly below 0
BIGRAMS = {"b": "?", "=": "4", "4": "8", "8": "2"}  # anything else -> end-of-sequence
ANSWER = "482"
FAULTY = "tests.envs.faulty_envs:FaultyEnv"
REPO_TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(save_char_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def token(tokenizer, text: str) -> int:
    (tid,) = tokenizer.encode(text, add_special_tokens=False)
    return int(tid)


def bigram_model(tokenizer) -> CausalLM:
    vocab = (len(tokenizer) + 31) // 32 * 32
    assert vocab <= HIDDEN
    torch.manual_seed(0)
    model = CausalLM(TINY.replace(vocab_size=vocab, hidden_size=HIDDEN, head_dim=32)).eval()
    model.init_weights(std=0.2)
    eos = int(tokenizer.eos_token_id)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, HIDDEN))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(vocab, HIDDEN)
        head[eos, :vocab] = GAP / math.sqrt(HIDDEN)  # the final norm scales one-hots by sqrt(H)
        for now, after in BIGRAMS.items():
            head[:, token(tokenizer, now)] = 0.0
            head[token(tokenizer, after), token(tokenizer, now)] = GAP / math.sqrt(HIDDEN)
        model.lm_head.weight.copy_(head)
    return model


def prompt_of(tokenizer, text: str, max_new_tokens: int, n: int = 1) -> tuple[Prompt, np.ndarray]:
    ids = np.asarray(tokenizer.encode(text), np.int32)  # with <bos>
    prompt = Prompt(
        uid="p",
        prompt_ids=TensorRef(dtype="int32", shape=(len(ids),), frame=0),
        n_samples=n,
        prompt_text="find 7 =",
        ground_truth=ANSWER,
        data_source="toy_lookup",
        max_new_tokens=max_new_tokens,
        temperature=0.0,
    )
    return prompt, ids


def drive(
    tokenizer,
    spec: str,
    prompt,
    ids,
    *,
    options=None,
    max_turns=3,
    step_timeout_s=10.0,
    keep_kv=True,
    engine_out: list | None = None,
):
    """The group's episodes, and the engine's model (for an independent forward)."""
    model = bigram_model(tokenizer)
    config = EnvironmentConfig(
        name=spec, max_turns=max_turns, step_timeout_s=step_timeout_s, keep_kv=keep_kv
    )

    async def group(driver):
        return await driver.run_group(prompt, ids)

    (samples, stats), counters, engine = with_driver(tokenizer, model, spec, options, config, group)
    if engine_out is not None:
        engine_out.append(engine)
    return samples, stats, model, counters


def with_driver(tokenizer, model, spec: str, options, config, body):
    """`await body(driver)` with an engine of `model`, a pool of `spec` and their runner, all
    closed after: its result, the pool's counters and the engine."""
    engine = TorchEngine(model, TorchEngineConfig(max_batch=8, max_seq_len=64, seed=0))
    pool = EnvPool(spec, options=options, workers=2, step_timeout_s=config.step_timeout_s)

    async def main():
        runner = EngineRunner(engine, tokenizer, asyncio.get_running_loop())
        try:
            return await body(EpisodeDriver(runner, tokenizer, pool, config))
        finally:
            await runner.close()

    try:
        return asyncio.run(main()), pool.counters, engine
    finally:
        pool.close()


def pieces(tokenizer, sample) -> list[tuple[str, bool]]:
    """The response as runs of text, each the policy's (True) or the environment's."""
    runs: list[tuple[str, bool]] = []
    for tid, m in zip(sample.response_ids.tolist(), sample.extra["loss_mask"], strict=True):
        text = tokenizer.decode([tid])
        if runs and runs[-1][1] == bool(m):
            runs[-1] = (runs[-1][0] + text, bool(m))
        else:
            runs.append((text, bool(m)))
    return runs


def check_token_fields(model: CausalLM, ids: np.ndarray, sample) -> None:
    """Policy tokens: the log-probs of one dense forward over prompt + whole response (so
    each turn was generated after the environment's tokens before it); environment tokens:
    log-prob 0; every token: version 0 (no update happened)."""
    mask = sample.extra["loss_mask"]
    assert mask.dtype == np.float32 and set(mask.tolist()) <= {0.0, 1.0}
    n = len(sample.response_ids)
    assert len(mask) == len(sample.behaviour_logprobs) == len(sample.token_versions) == n
    seq = torch.tensor([[*ids.tolist(), *sample.response_ids.tolist()]])
    with torch.no_grad():
        dense = model.token_logprobs(seq[:, :-1], seq[:, 1:])[0, len(ids) - 1 :]  # (n,)
    policy = mask > 0
    logprobs = torch.from_numpy(sample.behaviour_logprobs)
    torch.testing.assert_close(logprobs[policy], dense[policy].float(), atol=1e-4, rtol=0)
    assert (logprobs[policy] < -0.1).all()  # GAP keeps them visibly below 0
    assert (logprobs[~policy] == 0).all()
    assert (sample.token_versions == 0).all()


def test_a_tool_call_then_the_answer(tokenizer) -> None:
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=16, n=3)
    engines: list[TorchEngine] = []
    samples, stats, model, counters = drive(
        tokenizer, "toy_lookup", prompt, ids, engine_out=engines
    )
    assert [s.uid for s in samples] == ["p/0", "p/1", "p/2"]
    for sample in samples:
        # "?" ends the first turn; the tool's " 482 =" is the environment's; then the answer
        assert pieces(tokenizer, sample) == [("?", True), (" 482 =", False), ("482" + EOS, True)]
        assert sample.response_text == "? 482 =482"
        assert (sample.finish_reason, sample.score) == ("stop", 1.0)
        check_token_fields(model, ids, sample)
    assert stats["rollout/turns"] == 2.0
    assert stats["rollout/tool_calls"] == 1.0 and stats["rollout/tool_errors"] == 0.0
    assert stats["rollout/masked_tokens"] == 6.0
    # the KV cache kept across turns: nothing of turn 1 is prefilled again
    assert stats["rollout/recomputed_tokens"] == stats["rollout/kv_evicted"] == 0.0
    # each episode prefills the prompt and turn 2's 7 new tokens, or shares them with the
    # group's other episodes (the same sequence admitted together is prefilled once)
    assert (len(ids) + 7) / 3 <= stats["rollout/prefill_tokens"] <= len(ids) + 7
    assert len(engines[0].sessions) == 0  # every episode released its kept cache
    assert stats["rollout/env_errors"] == stats["rollout/env_timeouts"] == 0.0
    assert stats["rollout/env_seconds"] > 0
    assert (counters.episodes, counters.steps, counters.errors) == (3, 6, 0)


@pytest.mark.parametrize("keep_kv", [True, False], ids=["kv-kept", "kv-recomputed"])
def test_what_an_episode_prefills_with_its_kv_cache_kept_or_not(tokenizer, keep_kv) -> None:
    """Turn 2 is "?" (sampled last, never fed back) and the tool's 6 tokens: kept, the
    cache holds the rest; else turn 2 prefills the prompt and "?" again."""
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=16)
    (sample,), stats, model, _ = drive(tokenizer, "toy_lookup", prompt, ids, keep_kv=keep_kv)
    assert sample.response_text == "? 482 =482"
    check_token_fields(model, ids, sample)
    if keep_kv:
        assert stats["rollout/prefill_tokens"] == len(ids) + 7.0
        assert stats["rollout/recomputed_tokens"] == 0.0
    else:
        assert stats["rollout/prefill_tokens"] == 2 * len(ids) + 7.0
        assert stats["rollout/recomputed_tokens"] == len(ids)


def test_a_malformed_call_is_a_tool_error_and_the_episode_goes_on(tokenizer) -> None:
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=16)
    (sample,), stats, model, _ = drive(
        tokenizer, "toy_lookup", prompt, ids, options={"max_calls": 0}
    )
    assert pieces(tokenizer, sample) == [("?", True), (" no =", False), ("482" + EOS, True)]
    assert (sample.finish_reason, sample.score) == ("stop", 1.0)  # the answer still counts
    assert stats["rollout/tool_errors"] == 1.0 and stats["rollout/masked_tokens"] == 5.0
    check_token_fields(model, ids, sample)


def test_the_turn_limit_ends_an_episode_that_keeps_calling(tokenizer) -> None:
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=16)
    (sample,), stats, _, counters = drive(tokenizer, "toy_lookup", prompt, ids, max_turns=1)
    # the last turn's observation is not appended: no policy turn would follow it
    assert pieces(tokenizer, sample) == [("?", True)]
    assert (sample.finish_reason, sample.score) == ("turns", 0.0)
    assert stats["rollout/turns"] == 1.0 and stats["rollout/tool_calls"] == 1.0
    assert counters.steps == 1


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (9, [("?", True), (" 482 =", False), ("48", True)]),  # the answer cut mid-turn
        (4, [("?", True), (" 48", False)]),  # the observation cut, no budget for a turn
    ],
)
def test_the_token_budget_covers_environment_tokens_too(tokenizer, budget, expected) -> None:
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=budget)
    (sample,), stats, model, counters = drive(tokenizer, "toy_lookup", prompt, ids)
    assert len(sample.response_ids) == budget
    assert pieces(tokenizer, sample) == expected
    assert stats["rollout/masked_tokens"] == sum(len(text) for text, mine in expected if not mine)
    assert (sample.finish_reason, sample.score) == ("length", 0.0)
    assert counters.steps == 1  # no step for a turn the budget cut
    check_token_fields(model, ids, sample)


@pytest.mark.parametrize(
    ("max_turns", "done_after", "finish", "cancelled"),
    [(2, 0, "turns", True), (3, 2, "stop", False)],
    ids=["turn-limit", "done"],
)
def test_reset_text_comes_first_and_rewards_add_up(
    tokenizer, tmp_path: Path, max_turns: int, done_after: int, finish: str, cancelled: bool
) -> None:
    log = tmp_path / "closes"
    prompt, ids = prompt_of(tokenizer, "x", max_new_tokens=40, n=2)
    options = {"log": str(log), "done_after": done_after}
    samples, stats, model, _ = drive(
        tokenizer, FAULTY, prompt, ids, options=options, max_turns=max_turns
    )
    for i, sample in enumerate(samples):
        # FaultyEnv greets and echoes each (empty) turn with reward 1; the observation of
        # the last step is not appended either way
        assert pieces(tokenizer, sample) == [
            (f"hello p/{i}", False),
            (EOS, True),
            (f" p/{i}:1:", False),
            (EOS, True),
        ]
        assert (sample.finish_reason, sample.score) == (finish, 2.0)
        check_token_fields(model, ids, sample)
    assert stats["rollout/masked_tokens"] == 16.0 and stats["rollout/turns"] == 2.0
    # a turn limit cuts the episode short (types.py: close(cancelled))
    assert sorted(log.read_text().splitlines()) == [f"p/0 {cancelled}", f"p/1 {cancelled}"]


@pytest.mark.parametrize(
    ("option", "finish", "counter"),
    [("raise_on", "env_error", "env_errors"), ("hang_on", "env_timeout", "env_timeouts")],
)
def test_a_failed_step_ends_the_episode_with_no_reward(
    tokenizer, tmp_path: Path, option: str, finish: str, counter: str
) -> None:
    log = tmp_path / "closes"
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=16)
    options = {"greet": False, option: "?", "log": str(log)}
    (sample,), stats, model, counters = drive(
        tokenizer, FAULTY, prompt, ids, options=options, step_timeout_s=0.5
    )
    assert pieces(tokenizer, sample) == [("?", True)]
    assert (sample.finish_reason, sample.score) == (finish, 0.0)
    assert stats[f"rollout/{counter}"] == 1.0 and stats["rollout/turns"] == 1.0
    check_token_fields(model, ids, sample)
    if finish == "env_error":  # its instance still lives and is told it was cut short
        assert log.read_text().splitlines() == ["p/0 True"]
        assert (counters.errors, counters.restarts) == (1, 0)
    else:
        assert (counters.timeouts, counters.restarts, counters.lost) == (1, 1, 0)


def test_a_stop_string_must_be_one_token(tokenizer) -> None:
    assert stop_token_ids(tokenizer, ("?", "=")) == (token(tokenizer, "?"), token(tokenizer, "="))
    with pytest.raises(ConfigError, match="'</tool>' is 7 tokens"):
        stop_token_ids(tokenizer, ("</tool>",))


def test_reset_text_takes_the_version_of_the_first_policy_token(tokenizer, tmp_path) -> None:
    """A weight update lands between an episode's open and its first token: the reset text's
    tokens carry the first policy token's version, so the sample is no staler than its
    policy tokens (the learner's staleness filter reads the oldest token)."""
    prompt, ids = prompt_of(tokenizer, "x", max_new_tokens=40)
    model = bigram_model(tokenizer)
    engine = TorchEngine(model, TorchEngineConfig(max_batch=8, max_seq_len=64, seed=0))
    pool = EnvPool(FAULTY, options={"log": str(tmp_path / "closes")}, workers=1)
    config = EnvironmentConfig(name=FAULTY, max_turns=2)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    class UpdatedBeforeFirstTurn(EngineRunner):
        async def generate_turn(self, request, request_ids, extra_stop_ids, session):
            if self.version == 0:
                await asyncio.wrap_future(self.update_weights(weights, 1))
            return await super().generate_turn(request, request_ids, extra_stop_ids, session)

    async def main():
        runner = UpdatedBeforeFirstTurn(engine, tokenizer, asyncio.get_running_loop())
        try:
            return await EpisodeDriver(runner, tokenizer, pool, config).run_episode(prompt, ids, 0)
        finally:
            await runner.close()

    try:
        sample, _ = asyncio.run(main())
    finally:
        pool.close()
    mask = np.asarray(sample.extra["loss_mask"])
    assert mask[0] == 0 and (mask == 1).any()  # FaultyEnv greets: reset text comes first
    assert (np.asarray(sample.token_versions) == 1).all(), sample.token_versions


def test_a_group_whose_episodes_all_wait_on_the_environment_leaves_room(tokenizer) -> None:
    """While every open episode of a group is in an environment call, the group counts as
    waiting (the rollout service takes more prompts meanwhile) and the driver says so."""
    prompt, ids = prompt_of(tokenizer, "xb", max_new_tokens=16, n=2)
    slow = f"{REPO_TESTS / 'envs/faulty_envs.py'}:FlakyLookupEnv"
    config = EnvironmentConfig(name=slow, max_turns=3)
    seen: list[int] = []

    async def watch(driver):
        driver.on_wait = lambda: seen.append(driver.waiting_groups())
        group = asyncio.create_task(driver.run_group(prompt, ids))
        waiting = []
        while not group.done():
            waiting.append(driver.waiting_groups())
            await asyncio.sleep(0.01)
        await group
        return waiting, driver.waiting_groups()

    options = {"every": 10**9, "slow_s": 0.3}
    (waiting, after), _, _ = with_driver(
        tokenizer, bigram_model(tokenizer), slow, options, config, watch
    )
    # both episodes call the tool (0.3 s each call): the group waits, generates its answer
    # turns (in the engine: not waiting), waits on the answer's step, ends
    assert seen and set(seen) == {1}
    first = waiting.index(1)
    assert waiting.count(1) >= 10 and 0 in waiting[first:] and after == 0
