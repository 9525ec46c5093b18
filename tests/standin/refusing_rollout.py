"""The project's rollout, whose engine fails to load the first few weight updates from a
chosen version on: `REFUSING_ROLLOUT="3:2"` (the first 2 updates offered at version >= 3).
The receiver answers each such update WeightDone(ok=False, "apply: ..."), at once: the
engine stays a member of the weight group and keeps serving its old version, as after a
real failed load (no restart, no new registration)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from pipeline.weights.link import runner_receiver
from services.rollout.runner import prompts_in_flight, start_engine
from services.rollout.service import RolloutService
from tests.standin import service_main

ENV = "REFUSING_ROLLOUT"


class RefusingRollout(RolloutService):
    async def setup(self) -> None:
        # RolloutService.setup, with the engine's apply wrapped before the receiver takes it
        self.concurrency = prompts_in_flight(self.config)
        self.engine: Any = await start_engine(self.ctx)
        first, _, count = os.environ.get(ENV, "").partition(":")
        self._from, self._left = int(first or 0), int(count or 0)
        load = self.engine.update_weights

        def update_weights(tensors: Mapping[str, Any], version: int) -> Future[int]:
            if version >= self._from and self._left > 0:
                self._left -= 1
                self.log.warning("update_refused_for_test", version=version, pid=os.getpid())
                raise RuntimeError(f"could not load version {version} (refused for the test)")
            return load(tensors, version)

        self.engine.update_weights = update_weights
        self.receiver: Any = runner_receiver(self.ctx, self.engine)
        self.recompiles.mark()


SERVICE = RefusingRollout

main = service_main("rollout", RefusingRollout)


if __name__ == "__main__":
    raise SystemExit(main())
