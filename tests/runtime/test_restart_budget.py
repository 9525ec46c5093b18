"""A service may be restarted `supervisor.max_restarts` times within any
The supervisor's restart window (RESTART_WINDOW_S): crashes spread over a long run do not add up to its end
(issue 33, defect 6: the counter never reset), a crash loop still ends it."""

from __future__ import annotations

from pipeline.runtime.restart_budget import RestartBudget


def test_crashes_spread_over_the_run_are_all_restarted():
    budget = RestartBudget(limit=3, window_s=600.0)
    # one crash every 5 minutes for 10 hours: never more than 2 inside a 10-minute window
    assert all(budget.take(t * 300.0) for t in range(120))
    # two inside the last window (at 118 x 300 and 119 x 300 s): room for exactly one more
    assert budget.take(119 * 300.0) and not budget.take(119 * 300.0)


def test_a_crash_loop_ends_after_the_limit_within_the_window():
    budget = RestartBudget(limit=3, window_s=600.0)
    assert [budget.take(t) for t in (0.0, 1.0, 2.0, 3.0)] == [True, True, True, False]
    assert budget.take(600.0)  # the first has left the window
    assert budget.take(601.5)  # and the second
    assert not budget.take(601.9)  # 2.0, 600.0, 601.5 are inside it
