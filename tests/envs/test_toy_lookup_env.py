"""The toy lookup environment's tool delay: a lognormal wait per call, seeded per episode."""

from __future__ import annotations

import asyncio
import statistics
import time

from pipeline.envs.toy_lookup import LookupEnv
from pipeline.envs.types import Episode


def delays(uid: str, seed: int = 0, n: int = 400) -> list[float]:
    env = LookupEnv(tool_delay_s=0.5, tool_delay_sigma=0.8, tool_delay_seed=seed)
    env.reset(Episode(uid=uid, prompt_text="find 1 =", ground_truth="123"))
    return [env.delay_s() for _ in range(n)]


def test_delays_are_the_same_for_an_episode_and_a_seed_only() -> None:
    assert delays("7:a/0") == delays("7:a/0")
    assert delays("7:a/0") != delays("7:a/1")
    assert delays("7:a/0") != delays("7:a/0", seed=1)
    assert 0.4 < statistics.median(delays("7:a/0")) < 0.62


def test_no_delay_by_default_and_a_call_waits_its_delay() -> None:
    assert LookupEnv().delay_s() == 0.0
    env = LookupEnv(tool_delay_s=0.2, tool_delay_sigma=0.0)
    env.reset(Episode(uid="a", prompt_text="find 1 =", ground_truth="123"))
    start = time.monotonic()
    result = asyncio.run(env.step("?"))
    assert time.monotonic() - start >= 0.2
    assert (result.observation, result.tool_call) == (" 123 =", True)
    answer = asyncio.run(env.step("123"))  # the final answer does not wait
    assert (answer.reward, answer.done) == (1.0, True)
