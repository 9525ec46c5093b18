"""Episodes: the rollout service drives each sample of a prompt turn by turn.

A turn generates until end-of-sequence, one of the environment's stop strings or the
episode's token budget; its text goes to the environment, whose observation is appended as
environment tokens, and the next turn continues from the whole sequence. Other episodes keep
decoding in the engine's running batch while one waits for its environment. With
`environment.keep_kv` an episode is an engine session: the built-in engine keeps its KV cache
while it waits, and the next turn prefills only the environment's tokens (and the last one
sampled); otherwise, after a weight update under kv_on_update="recompute", or once evicted
for want of slots, it prefills the whole sequence again. Per episode: prefill_tokens, the
tokens prefilled; recomputed_tokens, those of them an earlier turn had already prefilled or
generated; kv_evicted, turns whose kept cache had been evicted.

A sample's response is every token after the prompt; `loss_mask` marks the policy's (1) and
the environment's (0). Environment tokens carry log-prob 0 and the version of the policy
token before them, so staleness is the policy tokens'.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.config.schema import EnvironmentConfig
from pipeline.envs.pool import EnvFailure, EnvPool
from pipeline.envs.types import Episode, StepResult, field_means
from pipeline.errors import ConfigError
from pipeline.wire.messages import Prompt, TensorRef
from pipeline.wire.samples import SampleArrays


@dataclass
class EpisodeStats:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    # 1 when the episode called its tool and every call was well formed
    tool_used: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    env_seconds: float = 0.0
    masked_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    kv_evicted: int = 0


@dataclass
class _Trace:
    """An episode's response so far: tokens, log-probs, versions, the policy's mask."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    mask: list[float]
    turn_end: int = 0  # sequence length (prompt included) at the end of the last turn

    def add(self, ids: Any, logprobs: Any, versions: Any, policy: bool) -> None:
        self.ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.mask += [1.0 if policy else 0.0] * len(ids)


def stop_token_ids(tokenizer: Any, stop: tuple[str, ...]) -> tuple[int, ...]:
    """The environment's stop strings as token ids: each must be one token."""
    ids = []
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(
                f"environment stop string {text!r} is {len(encoded)} tokens for this "
                "tokenizer; a stop string must be exactly one token"
            )
        ids.append(int(encoded[0]))
    return tuple(ids)


class EpisodeDriver:
    """Runs the episodes of prompts on an engine runner (`EngineRunner`) and an EnvPool."""

    def __init__(
        self,
        runner: Any,
        tokenizer: Any,
        pool: EnvPool,
        config: EnvironmentConfig,
        span: Callable[..., None] | None = None,
        on_wait: Callable[[], None] | None = None,
    ):
        self.runner = runner
        # the service's timeline (`Service.span`): each turn's generation and environment call
        self.span = span
        self.tokenizer = tokenizer
        self.pool = pool
        self.max_turns = config.max_turns
        self.keep_kv = config.keep_kv
        # called when a group's last open episode starts waiting on its environment
        self.on_wait = on_wait
        # prompt uid -> [episodes not finished, episodes in an environment call]
        self._groups: dict[str, list[int]] = {}
        self.stop_ids = stop_token_ids(tokenizer, pool.stop)

    async def run_group(
        self, prompt: Prompt, prompt_ids: np.ndarray
    ) -> tuple[list[SampleArrays], dict[str, float]]:
        """The prompt's `n_samples` episodes and their per-episode means (group stats)."""
        self._groups[prompt.uid] = [prompt.n_samples, 0]
        try:
            done = await asyncio.gather(
                *(self.run_episode(prompt, prompt_ids, i) for i in range(prompt.n_samples))
            )
        finally:
            del self._groups[prompt.uid]
        return [sample for sample, _ in done], field_means([s for _, s in done], "rollout/")

    async def run_episode(
        self, prompt: Prompt, prompt_ids: np.ndarray, index: int
    ) -> tuple[SampleArrays, EpisodeStats]:
        uid = f"{prompt.uid}/{index}"
        stats = EpisodeStats()
        trace = _Trace([], [], [], [])
        reward, finish, cancelled = 0.0, "length", True
        episode = Episode(
            uid=uid,
            prompt_text=prompt.prompt_text,
            ground_truth=prompt.ground_truth,
            data_source=prompt.data_source,
        )
        try:
            observation = await self._timed(stats, self.pool.open(episode), "env_reset", uid)
            self._observe(trace, observation, prompt.max_new_tokens, self.runner.version)
            for turn in range(self.max_turns):
                budget = prompt.max_new_tokens - len(trace.ids)
                if budget <= 0:
                    break
                out = await self._turn(prompt, prompt_ids, trace, (index, turn), budget, stats)
                if turn == 0 and len(out.token_versions):
                    # the reset text was tagged at open; a weight update may land before
                    # the first policy token, whose version it takes (staleness is policy's)
                    lead = len(trace.ids) - len(out.response_ids)
                    trace.versions[:lead] = [int(out.token_versions[0])] * lead
                if out.finish_reason != "stop":  # the token budget is spent mid-turn
                    break
                text = self.tokenizer.decode(out.response_ids.tolist(), skip_special_tokens=True)
                with self._waiting(prompt.uid):
                    result: StepResult = await self._timed(
                        stats, self.pool.step(uid, text), "env_step", uid
                    )
                reward += result.reward
                stats.tool_calls += int(result.tool_call)
                stats.tool_errors += int(result.tool_error)
                if result.done:
                    finish, cancelled = "stop", False
                    break
                if turn + 1 == self.max_turns:
                    finish = "turns"
                    break
                version = int(trace.versions[-1]) if trace.versions else self.runner.version
                self._observe(trace, result.observation, prompt.max_new_tokens, version)
        except EnvFailure as exc:
            finish, reward = f"env_{exc.kind}", 0.0
            if exc.kind == "timeout":
                stats.env_timeouts += 1
            else:
                stats.env_errors += 1
        except asyncio.CancelledError:
            self._end_session(uid)
            asyncio.get_running_loop().create_task(self.pool.close_episode(uid, True))
            raise
        self._end_session(uid)
        self._count(prompt.uid, 0, -1)
        await self._timed(stats, self.pool.close_episode(uid, cancelled), "env_close", uid)
        stats.masked_tokens = int(len(trace.mask) - sum(trace.mask))
        stats.tool_used = int(stats.tool_calls > 0 and stats.tool_errors == 0)
        ids = np.asarray(trace.ids, np.int32)
        sample = SampleArrays(
            uid=uid,
            response_ids=ids,
            behaviour_logprobs=np.asarray(trace.logprobs, np.float32),
            token_versions=np.asarray(trace.versions, np.int32),
            finish_reason=finish,
            response_text=self.tokenizer.decode(ids.tolist(), skip_special_tokens=True),
            score=reward,
            extra={"loss_mask": np.asarray(trace.mask, np.float32)},
        )
        return sample, stats

    async def _turn(
        self,
        prompt: Prompt,
        prompt_ids: np.ndarray,
        trace: _Trace,
        at: tuple[int, int],
        budget: int,
        stats: EpisodeStats,
    ) -> SampleArrays:
        index, turn = at
        ids = np.concatenate([np.asarray(prompt_ids, np.int32), np.asarray(trace.ids, np.int32)])
        request = Prompt(
            uid=f"{prompt.uid}/{index}/t{turn}",
            prompt_ids=TensorRef(dtype="int32", shape=(len(ids),), frame=0),
            n_samples=1,
            max_new_tokens=budget,
            ignore_eos=prompt.ignore_eos,
            temperature=prompt.temperature,
            top_p=prompt.top_p,
            top_k=prompt.top_k,
        )
        stats.turns += 1
        start = time.time()
        session = f"{prompt.uid}/{index}" if self.keep_kv else None
        out, cached, evicted = await self.runner.generate_turn(request, ids, self.stop_ids, session)
        prefilled = len(ids) - cached
        stats.prefill_tokens += prefilled
        if turn:  # new since the last turn: the environment's tokens and the last one sampled
            stats.recomputed_tokens += max(0, prefilled - (len(ids) - trace.turn_end) - 1)
        stats.kv_evicted += int(evicted)
        if self.span is not None:
            self.span("turn", start, time.time(), uid=request.uid, tokens=len(out.response_ids))
        trace.add(out.response_ids, out.behaviour_logprobs, out.token_versions, policy=True)
        trace.turn_end = len(ids) + len(out.response_ids)
        return out

    def waiting_groups(self) -> int:
        """Groups whose every open episode is in an environment call: none of theirs is in
        the engine's batch."""
        return sum(1 for left, waiting in self._groups.values() if left and waiting == left)

    @contextlib.contextmanager
    def _waiting(self, group: str) -> Iterator[None]:
        self._count(group, 1, 0)
        try:
            yield
        finally:
            self._count(group, -1, 0)

    def _count(self, group: str, waiting: int, left: int) -> None:
        if (counts := self._groups.get(group)) is None:
            return  # an episode run on its own (run_episode)
        counts[0] += left
        counts[1] += waiting
        if self.on_wait is not None and counts[0] and counts[1] == counts[0]:
            self.on_wait()

    def _end_session(self, uid: str) -> None:
        if self.keep_kv:
            self.runner.release(uid)

    def _observe(self, trace: _Trace, text: str, limit: int, version: int) -> None:
        if not text:
            return
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: limit - len(trace.ids)]
        trace.add(ids, [0.0] * len(ids), [version] * len(ids), policy=False)

    async def _timed(self, stats: EpisodeStats, call: Any, name: str, uid: str) -> Any:
        start = time.time()
        try:
            return await call
        finally:
            end = time.time()
            stats.env_seconds += end - start
            if self.span is not None:
                self.span(name, start, end, uid=uid)
