from __future__ import annotations

import os
import time

import pytest

from pipeline.rewards.registry import RewardNotFound
from pipeline.rewards.scorer import RewardScorer, ScorerError
from pipeline.rewards.types import ScoreItem, ScorerCounters

TIMEOUT_S = 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def scorer(user_rewards):
    table = {
        "exact": f"{user_rewards}:exact",
        "raises": f"{user_rewards}:raises",
        "hangs": f"{user_rewards}:hangs",
        "nan": f"{user_rewards}:nan",
        "as_dict": f"{user_rewards}:as_dict",
        "exits": f"{user_rewards}:exits",
        "pid": f"{user_rewards}:pid",
    }
    s = RewardScorer(table, timeout_s=TIMEOUT_S)
    yield s
    s.close()


async def test_raising_and_hanging_rewards_score_zero_and_the_rest_is_scored(scorer):
    old_pid = scorer.worker_pids[0]
    batch = [
        ScoreItem("good-1", "exact", "42", "42"),
        ScoreItem("raise", "raises", "42", "42"),
        ScoreItem("hang", "hangs", "42", "42"),
        ScoreItem("good-2", "exact", "41", "42"),
        ScoreItem("gsm8k", "openai/gsm8k", "so\n#### 1,000", "1000"),
        ScoreItem("good-3", "exact", "7", "7"),
    ]
    start = time.monotonic()
    results = await scorer.score_batch(batch)
    elapsed = time.monotonic() - start

    by_uid = {r.uid: r for r in results}
    assert [r.uid for r in results] == [item.uid for item in batch]
    assert (by_uid["raise"].score, by_uid["raise"].status) == (0.0, "error")
    assert "RuntimeError: reward bug on purpose" in by_uid["raise"].error
    assert (by_uid["hang"].score, by_uid["hang"].status) == (0.0, "timeout")
    assert [by_uid[u].score for u in ("good-1", "good-2", "gsm8k", "good-3")] == [1, 0, 1, 1]
    assert all(by_uid[u].status == "ok" for u in ("good-1", "good-2", "gsm8k", "good-3"))
    assert elapsed < TIMEOUT_S + 5  # the 60 s sleep was cut off
    assert scorer.counters == ScorerCounters(ok=4, errors=1, timeouts=1, worker_restarts=1)

    new_pid = scorer.worker_pids[0]
    assert new_pid != old_pid
    assert not _alive(old_pid)

    # The scorer keeps serving; the replacement worker does the user scoring now.
    more = await scorer.score_batch(
        [ScoreItem("next", "exact", "1", "1"), ScoreItem("who", "pid", "", "")]
    )
    assert [(r.score, r.status) for r in more] == [(1.0, "ok"), (float(new_pid), "ok")]
    assert scorer.counters.ok == 6


def test_crash_nan_and_dict_results(scorer):
    results = scorer.score_batch_sync(
        [
            ScoreItem("nan", "nan", "", ""),
            ScoreItem("dict", "as_dict", "", ""),
            ScoreItem("crash", "exits", "", ""),
            ScoreItem("after", "exact", "3", "3"),
        ]
    )
    assert [(r.status, r.score) for r in results] == [
        ("error", 0.0),
        ("ok", 0.25),
        ("error", 0.0),
        ("ok", 1.0),
    ]
    assert "non-finite" in results[0].error
    assert "died" in results[2].error
    assert scorer.counters.worker_restarts == 1


def test_unknown_data_source_and_unsendable_item_are_errors(user_rewards):
    with RewardScorer({"user": f"{user_rewards}:exact"}, timeout_s=TIMEOUT_S) as s:
        results = s.score_batch_sync(
            [
                ScoreItem("odd", "mystery", "1", "1"),
                ScoreItem("obj", "user", "1", "1", extra_info={"x": object()}),
                ScoreItem("ok", "user", "1", "1"),
            ]
        )
    assert [r.status for r in results] == ["error", "error", "ok"]
    assert "no built-in reward for data_source 'mystery'" in results[0].error
    assert "cannot be sent" in results[1].error


def test_missing_user_function_fails_at_startup(user_rewards):
    with pytest.raises(RewardNotFound, match="has no attribute 'nope'"):
        RewardScorer({"x": f"{user_rewards}:nope"})
    with pytest.raises(RewardNotFound, match="not found"):
        RewardScorer("no_such_pkg_xyz:fn")


def test_builtins_only_starts_no_worker():
    with RewardScorer("auto") as s:
        results = s.score_batch_sync([ScoreItem("a", "toy_reverse", "321", "321")])
        assert s.worker_pids == []
    assert results[0].score == 1.0


def test_close_is_idempotent_and_reaps_workers(user_rewards):
    s = RewardScorer({"x": f"{user_rewards}:exact"}, num_workers=2)
    pids = s.worker_pids
    assert len(pids) == 2
    s.close()
    s.close()
    assert s.worker_pids == []
    assert not any(_alive(p) for p in pids)
    with pytest.raises(ScorerError, match="after close"):
        s.score_batch_sync([ScoreItem("a", "x", "1", "1")])


def test_two_workers_time_out_in_parallel(user_rewards):
    table = {"hangs": f"{user_rewards}:hangs", "exact": f"{user_rewards}:exact"}
    with RewardScorer(table, timeout_s=TIMEOUT_S, num_workers=2) as s:
        start = time.monotonic()
        results = s.score_batch_sync(
            [ScoreItem(str(i), "hangs" if i < 2 else "exact", "1", "1") for i in range(6)]
        )
        elapsed = time.monotonic() - start
        assert [r.status for r in results] == ["timeout"] * 2 + ["ok"] * 4
        assert s.counters.timeouts == 2
        assert elapsed < 1.8 * TIMEOUT_S  # serial would take 2 timeouts
