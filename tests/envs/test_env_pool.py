"""EnvPool with real worker processes: an episode's calls, and every way user code can fail
one of them (raise, hang, garbage, exit) failing that episode only, counted, while the pool
goes on serving the others; a hung worker is killed by pid and replaced."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from pipeline.envs.pool import EnvFailure, EnvPool
from pipeline.envs.types import EnvironmentNotFound, Episode

SPEC = "tests.envs.faulty_envs:FaultyEnv"
FILE_SPEC = f"{Path(__file__).with_name('faulty_envs.py')}:FaultyEnv"


def episode(uid: str, prompt_text: str = "find 1 =") -> Episode:
    return Episode(uid=uid, prompt_text=prompt_text, ground_truth="123", data_source="test")


def children() -> set[int]:
    """This process's live child processes (from /proc, by parent pid)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    return pid in children()


@pytest.fixture
def make_pool():
    pools: list[EnvPool] = []

    def make(spec: str = SPEC, **kwargs) -> EnvPool:
        pools.append(EnvPool(spec, **kwargs))
        return pools[-1]

    try:
        yield make
    finally:
        for pool in pools:
            pool.close()


async def pool_of_a_and_b(make_pool) -> tuple[EnvPool, int]:
    """A pool of one worker that hosts the open episodes "a" and "b"; its worker's pid."""
    pool = make_pool(workers=1)
    await pool.open(episode("a"))
    await pool.open(episode("b"))
    return pool, pool.worker_pids[0]


async def test_an_episode_opens_steps_and_closes(make_pool, tmp_path: Path) -> None:
    log = tmp_path / "closes"
    pool = make_pool(options={"log": str(log)}, workers=2)
    assert pool.stop == ("?",)
    assert len(pool.worker_pids) == 2 and set(pool.worker_pids) <= children()
    assert await pool.open(episode("a")) == "hello a"
    first = await pool.step("a", "look")
    assert (first.observation, first.reward, first.done) == (" a:1:look", 1.0, False)
    last = await pool.step("a", "done")  # the instance kept its state between the calls
    assert (last.observation, last.done) == (" a:2:done", True)
    await pool.close_episode("a", cancelled=False)
    await pool.open(episode("b"))
    await pool.close_episode("b", cancelled=True)
    assert log.read_text().splitlines() == ["a False", "b True"]
    c = pool.counters
    assert (c.episodes, c.steps, c.errors, c.timeouts, c.lost, c.restarts) == (2, 2, 0, 0, 0, 0)
    # a call for a closed episode fails as lost instead of reaching some other instance
    with pytest.raises(EnvFailure) as closed:
        await pool.step("a", "look")
    assert closed.value.kind == "lost"


async def test_episodes_spread_over_the_workers_and_a_file_spec_loads(make_pool) -> None:
    pool = make_pool(FILE_SPEC, workers=2)
    for uid in ("a", "b", "c", "d"):
        await pool.open(episode(uid))
    pids = [int((await pool.step(uid, "pid")).observation) for uid in ("a", "b", "c", "d")]
    assert sorted(pids) == sorted(pool.worker_pids * 2)  # two episodes per worker


async def test_coroutine_methods_are_awaited(make_pool) -> None:
    pool = make_pool("tests.envs.faulty_envs:AsyncEnv")
    assert await pool.open(episode("a")) == "async hello"
    result = await pool.step("a", "shout")
    assert (result.observation, result.done, result.reward) == ("SHOUT", True, 0.5)


async def test_awaited_tool_delays_of_two_episodes_overlap(make_pool) -> None:
    """One worker: the toy lookup tool's delays (awaited) do not serialize the episodes."""
    delay = 0.6
    options = {"tool_delay_s": delay, "tool_delay_sigma": 0.0}
    pool = make_pool("toy_lookup", options=options, workers=1)
    assert pool.concurrent
    for uid in ("a", "b"):
        await pool.open(episode(uid))
    start = time.monotonic()
    results = await asyncio.gather(pool.step("a", "?"), pool.step("b", "?"))
    wall = time.monotonic() - start
    assert [r.observation for r in results] == [" 123 =", " 123 ="]
    assert delay <= wall < 1.6 * delay, wall  # one delay, not two


async def test_a_plain_environment_takes_one_call_at_a_time(make_pool) -> None:
    pool, _ = await pool_of_a_and_b(make_pool)
    assert not pool.concurrent


async def one_async_worker_with_a_and_b(make_pool) -> tuple[EnvPool, int]:
    """A pool of one worker hosting episodes a and b of a coroutine environment; its pid."""
    pool = make_pool("tests.envs.faulty_envs:AsyncEnv", workers=1, step_timeout_s=1.0)
    for uid in ("a", "b"):
        await pool.open(episode(uid))
    return pool, pool.worker_pids[0]


async def test_a_hung_coroutine_fails_alone_while_the_worker_serves_others(make_pool) -> None:
    pool, old = await one_async_worker_with_a_and_b(make_pool)

    async def served_meanwhile() -> float:
        await asyncio.sleep(0.05)
        assert (await pool.step("b", "wait 0.2")).observation == "WAIT 0.2"
        return time.monotonic()

    start = time.monotonic()
    hung, other = await asyncio.gather(
        pool.step("a", "hang"), served_meanwhile(), return_exceptions=True
    )
    assert isinstance(hung, EnvFailure) and hung.kind == "timeout", hung
    assert isinstance(other, float) and other - start < 1.0
    assert pool.worker_pids[0] != old and not alive(old)
    c = pool.counters
    assert (c.timeouts, c.lost, c.restarts) == (1, 0, 1)


async def test_a_blocked_worker_is_killed_and_its_calls_in_flight_are_lost(make_pool) -> None:
    pool, old = await one_async_worker_with_a_and_b(make_pool)

    async def behind() -> object:
        await asyncio.sleep(0.1)  # sent while the worker's loop is blocked
        return await pool.step("b", "look")

    blocked, lost = await asyncio.gather(pool.step("a", "block"), behind(), return_exceptions=True)
    assert isinstance(blocked, EnvFailure) and blocked.kind == "timeout", blocked
    assert isinstance(lost, EnvFailure) and lost.kind == "lost", lost
    assert pool.worker_pids[0] != old and not alive(old)
    await pool.open(episode("c"))
    assert int((await pool.step("c", "pid")).observation) == pool.worker_pids[0]
    c = pool.counters
    assert (c.timeouts, c.lost, c.restarts) == (1, 1, 1)


async def test_a_step_that_raises_fails_its_episode_only(make_pool) -> None:
    pool, pid = await pool_of_a_and_b(make_pool)
    with pytest.raises(EnvFailure) as failed:
        await pool.step("a", "raise")
    assert failed.value.kind == "error"
    assert "ValueError: step failed on purpose" in str(failed.value)
    assert (await pool.step("b", "look")).observation == " b:1:look"
    assert (await pool.step("a", "look")).observation == " a:1:look"  # its instance lives on
    assert pool.worker_pids == [pid]
    c = pool.counters
    assert (c.errors, c.timeouts, c.lost, c.restarts) == (1, 0, 0, 0)


async def test_a_reset_that_raises_or_returns_no_text_is_an_error(make_pool) -> None:
    pool = make_pool(workers=1)
    for uid, text, why in [("r", "raise", "RuntimeError"), ("g", "garbage", "not str")]:
        with pytest.raises(EnvFailure) as failed:
            await pool.open(episode(uid, text))
        assert failed.value.kind == "error" and why in str(failed.value)
        await pool.close_episode(uid, cancelled=True)
    assert await pool.open(episode("ok")) == "hello ok"
    assert (pool.counters.errors, pool.counters.restarts) == (2, 0)


@pytest.mark.parametrize(
    ("action", "why"),
    [
        ("garbage", "dict, not a StepResult"),
        ("bad types", "observation is int"),
        ("bad flag", "done is int"),
        ("nan", "not finite"),
        ("surrogate", "surrogates not allowed"),  # msgpack cannot encode the reply
        ("raise surrogate", "ValueError: half a pair: \\ud800"),
        ("exit", "SystemExit"),
    ],
)
async def test_garbage_from_step_is_an_error_and_the_worker_lives_on(
    make_pool, action: str, why: str
) -> None:
    pool, pid = await pool_of_a_and_b(make_pool)
    with pytest.raises(EnvFailure) as failed:
        await pool.step("a", action)
    assert failed.value.kind == "error" and why in str(failed.value), str(failed.value)
    assert (await pool.step("b", "look")).observation == " b:1:look"
    assert pool.worker_pids == [pid] and alive(pid)
    c = pool.counters
    assert (c.errors, c.timeouts, c.lost, c.restarts) == (1, 0, 0, 0)


async def test_a_hung_step_times_out_the_worker_is_replaced_its_other_episodes_are_lost(
    make_pool,
) -> None:
    timeout = 1.0  # long enough for worker 1's answer on a busy machine
    pool = make_pool(workers=2, step_timeout_s=timeout)
    for uid in ("a", "b", "c", "d"):  # a, c on worker 0; b, d on worker 1
        await pool.open(episode(uid))
    home = {uid: int((await pool.step(uid, "pid")).observation) for uid in "abcd"}
    hung_pid, other_pid = home["a"], home["b"]
    assert home["c"] == hung_pid and home["d"] == other_pid != hung_pid

    async def served_meanwhile() -> float:
        await asyncio.sleep(0.05)
        result = await pool.step("b", "look")  # worker 1 is not held up by worker 0
        assert result.observation == " b:1:look"
        return time.monotonic()

    start = time.monotonic()
    hung, other = await asyncio.gather(
        pool.step("a", "hang"), served_meanwhile(), return_exceptions=True
    )
    failed_after = time.monotonic() - start
    assert isinstance(hung, EnvFailure) and hung.kind == "timeout", hung
    assert isinstance(other, float) and other - start < timeout
    assert timeout <= failed_after < timeout + 3.0
    new_pid = next(p for p in pool.worker_pids if p != other_pid)
    assert new_pid != hung_pid and not alive(hung_pid) and alive(new_pid)
    assert (pool.counters.timeouts, pool.counters.restarts) == (1, 1)
    # c lived in the killed worker: its instance is gone
    with pytest.raises(EnvFailure) as lost:
        await pool.step("c", "look")
    assert lost.value.kind == "lost"
    assert (await pool.step("d", "look")).observation == " d:1:look"
    for uid in "abcd":
        await pool.close_episode(uid, cancelled=uid in "ac")
    # a new episode gets a working instance in the new worker
    await pool.open(episode("e"))
    assert int((await pool.step("e", "pid")).observation) == new_pid
    c = pool.counters
    # one episode timed out, one was lost: each counted once (closing them counts nothing)
    assert (c.timeouts, c.lost, c.errors, c.restarts) == (1, 1, 0, 1)


async def test_a_hung_reset_times_out(make_pool) -> None:
    pool = make_pool(workers=1, step_timeout_s=0.5)
    old = pool.worker_pids
    with pytest.raises(EnvFailure) as failed:
        await pool.open(episode("h", "hang"))
    assert failed.value.kind == "timeout"
    await pool.close_episode("h", cancelled=True)
    assert await pool.open(episode("ok")) == "hello ok"
    assert pool.worker_pids != old
    assert (pool.counters.timeouts, pool.counters.lost, pool.counters.restarts) == (1, 0, 1)


async def test_a_worker_that_dies_in_user_code_is_replaced(make_pool) -> None:
    pool, old = await pool_of_a_and_b(make_pool)
    with pytest.raises(EnvFailure) as died:
        await pool.step("a", "die")
    assert died.value.kind == "lost" and "died" in str(died.value)
    with pytest.raises(EnvFailure) as lost:
        await pool.step("b", "look")
    assert lost.value.kind == "lost"
    await pool.open(episode("c"))
    assert int((await pool.step("c", "pid")).observation) == pool.worker_pids[0] != old
    assert (pool.counters.lost, pool.counters.restarts) == (2, 1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_env", "unknown environment 'no_such_env'; built-ins are gsm8k_python, toy"),
        ("tests.envs.no_such_module:Env", "module 'tests.envs.no_such_module' not found"),
        ("tests.envs.faulty_envs:Missing", "has no attribute 'Missing'"),
        ("tests.envs.faulty_envs:NOT_A_CLASS", "is not a class with a step method"),
        ("/no/such/file.py:Env", "does not exist"),
    ],
)
def test_an_unknown_environment_is_refused_at_construction(spec: str, message: str) -> None:
    before = children()
    with pytest.raises(EnvironmentNotFound) as refused:
        EnvPool(spec, workers=2)
    assert message in str(refused.value)
    assert children() <= before  # the workers it started are gone


def test_close_stops_every_worker_and_is_idempotent() -> None:
    pool = EnvPool(SPEC, workers=2)
    pids = pool.worker_pids
    assert set(pids) <= children()
    pool.close()
    pool.close()
    assert not set(pids) & children()


async def test_an_episode_opened_behind_a_hung_call_opens_in_the_new_worker(make_pool) -> None:
    """It was queued for the worker, not hosted by it: nothing of it was lost."""
    pool = make_pool(workers=1, step_timeout_s=0.5)
    await pool.open(episode("a"))
    old = pool.worker_pids

    async def open_later() -> str:
        await asyncio.sleep(0.1)  # the hung call holds the worker by now
        return await pool.open(episode("b"))

    hung, opened = await asyncio.gather(
        pool.step("a", "hang"), open_later(), return_exceptions=True
    )
    assert isinstance(hung, EnvFailure) and hung.kind == "timeout"
    assert opened == "hello b", opened
    assert pool.worker_pids != old
    assert int((await pool.step("b", "pid")).observation) == pool.worker_pids[0]
    assert (pool.counters.timeouts, pool.counters.lost, pool.counters.restarts) == (1, 0, 1)
