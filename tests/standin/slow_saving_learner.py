"""The project's learner, whose last save at the run's end takes `SLOW_SAVE_S` seconds
longer (a large model's checkpoint)."""

from __future__ import annotations

import asyncio
import os

from services.learner.service import LearnerService
from tests.standin import service_main

ENV = "SLOW_SAVE_S"


class SlowSavingLearner(LearnerService):
    async def teardown(self) -> None:
        await asyncio.sleep(float(os.environ.get(ENV, "0")))
        await super().teardown()


SERVICE = SlowSavingLearner

main = service_main("learner", SlowSavingLearner)


if __name__ == "__main__":
    raise SystemExit(main())
