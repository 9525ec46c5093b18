"""A controller's side for one service under `serve` in the test process: its control
server (answering the handshake with the run's config) and a prompts queue with items."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import PipelineConfig, config_to_json
from pipeline.runtime import layout
from pipeline.transport import ControlServer, QueueServer
from pipeline.wire.messages import ConfigMsg, Hello
from tests.transport.test_queue_inprocess import prompt
from tests.transport.test_queue_stall import STALL


async def controller_side(
    config: PipelineConfig, run_dir: Path, prompts: int
) -> tuple[ControlServer, QueueServer]:
    """Started on the caller's loop (the test's side thread), `prompts` items queued."""

    def answer(hello: Hello) -> ConfigMsg:
        return ConfigMsg(run_id="run1", run_dir=str(run_dir), config_json=config_to_json(config))

    control = ControlServer(
        layout.controller_endpoint(config), run_id="run1", config_for=answer, config=STALL
    ).start()
    queue = QueueServer(
        "prompts",
        layout.bind_endpoint(config, "prompts", 0),
        run_id="run1",
        sender="controller",
        config=STALL,
    ).start()
    for i in range(prompts):
        await queue.send(*prompt(i))
    return control, queue
