"""A service told to stop ends its main loop before its teardown runs, never beside it.
The default loop cancels a handler in flight (its item stays unacknowledged and goes
again); a loop of its own (the learner's) may finish the step it is in first."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

from pipeline.config import load_config
from pipeline.runtime.service import Output, Service, serve
from pipeline.transport import QueueServer
from pipeline.wire import codec
from pipeline.wire.messages import Shutdown
from tests.runtime.serve_harness import controller_side
from tests.transport.loop_thread import LoopThread, wait_until

REPO = Path(__file__).resolve().parents[2]
EVENTS: list[str] = []


class StuckHandler(Service):
    role = "rollout"
    concurrency = 1  # the loop waits on the one handler in flight

    async def handle(self, message: codec.Message) -> list[Output]:
        EVENTS.append("handling")
        try:
            await asyncio.Event().wait()  # would not finish by itself
        finally:
            EVENTS.append("handler_ended")
        return []

    async def teardown(self) -> None:
        EVENTS.append("teardown")


class StepLoop(Service):
    """A main loop of its own that checks for the stop between steps, as the learner's."""

    role = "rollout"
    steps: ClassVar[float] = 0.5  # seconds a step takes: within half the stop timeout

    async def run(self) -> None:
        while not self.ctx.stop.is_set():
            EVENTS.append("step_started")
            await asyncio.sleep(self.steps)
            EVENTS.append("step_done")

    async def handle(self, message: codec.Message) -> list[Output]:
        return []

    async def teardown(self) -> None:
        EVENTS.append("teardown")


async def _stop_while(
    service_cls: type[Service], busy: str, tmp_path: Path, side: LoopThread
) -> QueueServer:
    """Serve `service_cls`, tell it to stop once `busy` happened; the prompts queue."""
    config = load_config(
        REPO / "profiles/local-cpu.toml",
        {
            "run.runs_dir": str(tmp_path),
            "run.name": "stop",
            "queues.record": "[]",
            "supervisor.stop_timeout_s": "3",  # a main loop has 1.5 s to end by itself
        },
    )
    control, prompts = await side.call(controller_side(config, tmp_path, 1))
    EVENTS.clear()
    service = asyncio.create_task(
        serve(service_cls, controller=control.endpoint, replica=0, local_config=config)
    )
    try:
        await wait_until(lambda: busy in EVENTS, 20, busy)
        await side.call(control.broadcast(Shutdown(reason="test over")))
        await asyncio.wait_for(service, 10)
        return prompts
    finally:
        if not service.done():
            service.cancel()
        await side.call(prompts.close())
        await side.call(control.close())


async def test_a_handler_in_flight_is_cancelled_before_teardown(
    tmp_path: Path, side: LoopThread
) -> None:
    prompts = await _stop_while(StuckHandler, "handling", tmp_path, side)
    assert EVENTS == ["handling", "handler_ended", "teardown"]
    assert prompts.unacked == 1  # not acknowledged: it would go again


async def test_a_step_in_flight_finishes_before_teardown(tmp_path: Path, side: LoopThread) -> None:
    await _stop_while(StepLoop, "step_started", tmp_path, side)
    assert EVENTS == ["step_started", "step_done", "teardown"]
