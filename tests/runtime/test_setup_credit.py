"""A service grants its input credit only once its setup is done (issue 33, defect 11).

Setup blocks the event loop for seconds (imports, a tokenizer, a checkpoint lookup), so no
heartbeat goes out meanwhile: credit granted before it would be items shipped to a replica
that cannot take them, and a consumer the producer declares dead for its silence.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, ClassVar

from pipeline.config import load_config
from pipeline.runtime.service import Output, Service, serve
from pipeline.wire import codec
from pipeline.wire.messages import Shutdown
from tests.runtime.serve_harness import controller_side
from tests.transport.loop_thread import LoopThread, wait_until
from tests.transport.test_queue_stall import STALL

REPO = Path(__file__).resolve().parents[2]
SETUP_S = 2.0  # twice the peer timeout


class SlowSetup(Service):
    role = "rollout"
    # what the prompts producer had done when setup returned: (sent, dead consumers)
    seen: ClassVar[list[tuple[int, int]]] = []
    producer: ClassVar[Any] = None
    side: ClassVar[Any] = None

    async def setup(self) -> None:
        time.sleep(SETUP_S)  # a blocking load, as the real services' are

        async def counters() -> tuple[int, int]:
            return self.producer.stats.sent, self.producer.stats.dead_peers

        SlowSetup.seen.append(self.side.call_blocking(counters()))

    async def handle(self, message: codec.Message) -> list[Output]:
        return []


async def test_input_credit_is_granted_after_setup(tmp_path: Path, side: LoopThread) -> None:
    config = load_config(
        REPO / "profiles/local-cpu.toml",
        {
            "run.runs_dir": str(tmp_path),
            "run.name": "slow-setup",
            "queues.peer_timeout_s": str(STALL.peer_timeout_s),
            "queues.record": "[]",
        },
    )

    control, prompts = await side.call(controller_side(config, tmp_path, 3))
    SlowSetup.seen, SlowSetup.producer, SlowSetup.side = [], prompts, side
    service = asyncio.create_task(
        serve(SlowSetup, controller=control.endpoint, replica=0, local_config=config)
    )
    try:
        await wait_until(lambda: prompts.unacked == 0 or service.done(), 20, "the 3 prompts")
        # nothing went to the replica while it loaded, so nothing waited on it meanwhile
        assert SlowSetup.seen == [(0, 0)]
        assert prompts.stats.dead_peers == 0 and prompts.stats.redelivered == 0
        # the control plane's heartbeats stopped during setup too: it takes the replica
        # back (`_departed`) at its next one; tell it to stop only then
        peers = control.peers.values
        await wait_until(
            lambda: any(p.ready and p.hello.service == "rollout" for p in peers()),
            5,
            "the replica back",
        )
        await side.call(control.broadcast(Shutdown(reason="test over")))
        await asyncio.wait_for(service, 10)
    finally:
        if not service.done():
            service.cancel()
        await side.call(prompts.close())
        await side.call(control.close())
