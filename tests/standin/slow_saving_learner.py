"""The project's learner, whose last save at the run's end takes `SLOW_SAVE_S` seconds
longer (a large model's checkpoint)."""

from __future__ import annotations

import asyncio
import os

from services.learner import LearnerService

ENV = "SLOW_SAVE_S"


class SlowSavingLearner(LearnerService):
    async def teardown(self) -> None:
        await asyncio.sleep(float(os.environ.get(ENV, "0")))
        await super().teardown()


SERVICE = SlowSavingLearner


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("learner", SlowSavingLearner, argv)


if __name__ == "__main__":
    raise SystemExit(main())
