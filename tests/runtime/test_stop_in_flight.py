"""A service told to stop while a handler is in flight: the handler ends before the
service's teardown runs, never beside it. One that finishes within half the stop timeout
acknowledges its item; one that would not finish is cancelled and its item stays
unacknowledged (it goes again)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

import pytest

from pipeline import codec
from pipeline.config import load_config
from pipeline.messages import Shutdown
from pipeline.runtime.service import Output, Service, serve
from tests.runtime.serve_harness import controller_side
from tests.transport.loop_thread import LoopThread, wait_until

REPO = Path(__file__).resolve().parents[2]


class SlowHandler(Service):
    role = "rollout"
    concurrency = 1  # the loop waits on the one handler in flight
    events: ClassVar[list[str]] = []
    seconds: ClassVar[float] = 0.0  # how long a handler takes; inf: it never finishes

    async def handle(self, message: codec.Message) -> list[Output]:
        SlowHandler.events.append("handling")
        try:
            if SlowHandler.seconds == float("inf"):
                await asyncio.Event().wait()
            await asyncio.sleep(SlowHandler.seconds)
        finally:
            SlowHandler.events.append("handler_ended")
        return []

    async def teardown(self) -> None:
        SlowHandler.events.append("teardown")


@pytest.mark.parametrize(("seconds", "unacked"), [(0.5, 0), (float("inf"), 1)])
async def test_a_handler_in_flight_ends_before_teardown(
    tmp_path: Path, side: LoopThread, seconds: float, unacked: int
) -> None:
    config = load_config(
        REPO / "profiles/local-cpu.toml",
        {
            "run.runs_dir": str(tmp_path),
            "run.name": "stop",
            "queues.record": "[]",
            "supervisor.stop_timeout_s": "3",  # a handler has 1.5 s to finish
        },
    )

    control, prompts = await side.call(controller_side(config, tmp_path, 1))
    SlowHandler.events, SlowHandler.seconds = [], seconds
    service = asyncio.create_task(
        serve(SlowHandler, controller=control.endpoint, replica=0, local_config=config)
    )
    try:
        await wait_until(lambda: "handling" in SlowHandler.events, 20, "the handler")
        await side.call(control.broadcast(Shutdown(reason="test over")))
        await asyncio.wait_for(service, 10)
        assert SlowHandler.events == ["handling", "handler_ended", "teardown"]
        await wait_until(lambda: prompts.unacked == unacked, 5, f"{unacked} unacknowledged")
        assert prompts.unacked == unacked
    finally:
        if not service.done():
            service.cancel()
        await side.call(prompts.close())
        await side.call(control.close())
