"""How many times one service may be restarted: at most `limit` restarts within any
`window_s` seconds, so that a few crashes spread over a long run do not end it while a
crash loop still does."""

from __future__ import annotations

from collections import deque

from pipeline.errors import EXIT_CONFIG


class RestartBudget:
    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Whether a restart at `now` (monotonic seconds) is within the budget; if so it
        counts."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True


def restartable(role: str, code: int) -> bool:
    """Whether a service that exited with `code` (negative: killed by that signal) is
    started again, budget permitting: not one that finished (0) or refused its config (a
    restart would refuse it again); a controller only when a signal killed it (it resumes
    from its journal), since one that exits on its own has ended the run."""
    if code == 0 or code == EXIT_CONFIG:
        return False
    return code < 0 if role == "controller" else True
