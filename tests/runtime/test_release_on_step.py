"""The controller releases the next step's prompts as soon as a step is journaled (the
staleness bound moves then), not at its next look at the budget: at staleness 0 every
step waits for those prompts. The poll is set to 30 s here, so only the step's own wake-up
can release them within the test's 5 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.config.profile import load_config
from pipeline.transport.control import ControlServer
from pipeline.transport.queue_server import QueueServer
from pipeline.wire.messages import StepDone
from services.controller import service as controller_module
from services.controller.service import Controller


async def _wait_for(condition, seconds: float) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), seconds)


def test_a_journaled_step_releases_the_next_steps_prompts_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "RELEASE_POLL_S", 30.0)
    overrides = {
        "controller.prompts_per_step": "2",
        "controller.max_staleness": "0",
        "controller.steps": "3",
        "task.warm_start_steps": "0",
    }
    ctl = Controller(load_config("profiles/local-cpu.toml", overrides), tmp_path / "run")
    ctl.prepare()

    async def scenario() -> None:
        prompts = QueueServer(
            "prompts", f"ipc://{tmp_path}/prompts", run_id=ctl.run_id, sender="controller-0"
        ).start()
        control = ControlServer(
            f"ipc://{tmp_path}/control", run_id=ctl.run_id, config_for=ctl.config_for
        ).start()
        release = asyncio.create_task(ctl.release_loop(prompts))
        try:
            await _wait_for(lambda: ctl.released_count == 2, 5.0)  # step 0's prompts
            await asyncio.sleep(0.1)  # the loop now waits on its (30 s) poll
            assert ctl.released_count == 2  # the staleness bound holds step 1 back
            uids = [p.uid for p in ctl.state.unsettled()]
            await ctl.on_step_done(StepDone(step=0, policy_version=1, trained_uids=uids), control)
            await _wait_for(lambda: ctl.released_count == 4, 5.0)
        finally:
            release.cancel()
            await asyncio.gather(release, return_exceptions=True)
            await prompts.close()
            await control.close()

    try:
        asyncio.run(scenario())
    finally:
        ctl.journal.close()
