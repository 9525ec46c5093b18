"""A learner without a model: it collects, accounts for and reports each step, and trains
nothing (the run's plumbing alone)."""

from __future__ import annotations

from services.learner.service import LearnerService
from tests.standin import service_main


class StandinLearner(LearnerService):
    async def _build(self) -> None:
        """No trainer and no weights to publish: steps go on from the controller's."""


SERVICE = StandinLearner

main = service_main("learner", StandinLearner)


if __name__ == "__main__":
    raise SystemExit(main())
