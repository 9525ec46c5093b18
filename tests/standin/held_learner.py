"""The project's learner, parked at chosen points of chosen steps so that a test can
SIGKILL it there: `HELD_LEARNER="checkpointed@2,reported@4"` (after that step's
checkpoint; after its report, before its acks)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from services.learner.service import LearnerService
from services.learner.worker import TrainedStep
from tests.standin import service_main

ENV = "HELD_LEARNER"


def hold_points(spec: str) -> set[tuple[str, int]]:
    """`point@step,...` -> {(point, step)}."""
    holds = set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        point, _, step = item.partition("@")
        if point not in ("checkpointed", "reported") or not step.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not checkpointed@<step> or reported@<step>")
        holds.add((point, int(step)))
    return holds


class HeldLearner(LearnerService):
    async def _park(self, point: str, step: int) -> None:
        if (point, step) in hold_points(os.environ.get(ENV, "")):
            self.log.warning("held_for_test", point=point, step=step, pid=os.getpid())
            await asyncio.Event().wait()

    async def _checkpoint(self, trained: TrainedStep) -> None:
        await super()._checkpoint(trained)
        await self._park("checkpointed", trained.done.step)

    async def report(self, step: int, values: dict[str, Any]) -> None:
        await super().report(step, values)
        await self._park("reported", step)


SERVICE = HeldLearner

main = service_main("learner", HeldLearner)


if __name__ == "__main__":
    raise SystemExit(main())
