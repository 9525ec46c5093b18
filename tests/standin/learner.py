"""A learner without a model: it collects, accounts for and reports each step, and trains
nothing (the run's plumbing alone)."""

from __future__ import annotations

from services.learner import LearnerService


class StandinLearner(LearnerService):
    async def _build(self) -> None:
        """No trainer and no weights to publish: steps go on from the controller's."""


SERVICE = StandinLearner


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import run_service

    return run_service("learner", StandinLearner, argv)


if __name__ == "__main__":
    raise SystemExit(main())
