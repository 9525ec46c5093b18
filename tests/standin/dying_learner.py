"""The project's learner, whose first incarnation dies (SIGKILL) as soon as the
controller tells it the run is over: the supervisor restarts it just as the run ends.
`DIE_MARKER`: a file that marks the first incarnation as gone."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from services.learner.service import LearnerService
from tests.standin import service_main

ENV = "DIE_MARKER"


class DyingLearner(LearnerService):
    async def teardown(self) -> None:
        marker = Path(os.environ[ENV])
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        await super().teardown()


SERVICE = DyingLearner

main = service_main("learner", DyingLearner)


if __name__ == "__main__":
    raise SystemExit(main())
