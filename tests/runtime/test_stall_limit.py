"""The controller's stall limit: the first step it sees may take longer (every service
compiles on its first batch), the later ones get step_timeout_s."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from pipeline.config import PipelineConfig
from services.controller.service import Controller


def controller(tmp_path: Path, step_s: float, first_s: float) -> Controller:
    config = PipelineConfig()
    limits = dataclasses.replace(
        config.controller, step_timeout_s=step_s, first_step_timeout_s=first_s
    )
    return Controller(dataclasses.replace(config, controller=limits), tmp_path)


def test_the_first_step_gets_its_own_limit_until_a_step_finishes(tmp_path: Path) -> None:
    ctl = controller(tmp_path, step_s=60.0, first_s=900.0)
    assert ctl.stall_limit() == 900.0
    ctl.stepped = True  # as on_step_done sets it
    assert ctl.stall_limit() == 60.0


def test_no_first_step_limit_means_step_timeout_throughout(tmp_path: Path) -> None:
    assert controller(tmp_path, step_s=60.0, first_s=0.0).stall_limit() == 60.0


def test_the_watchdog_waits_out_the_first_step_limit(tmp_path: Path) -> None:
    """No step for 1.2 s: past step_timeout_s (0.3 s), within first_step_timeout_s (3 s)
    the run is not stalled; once a step has finished, 0.3 s without one is."""
    ctl = controller(tmp_path, step_s=0.3, first_s=3.0)

    async def stalls_within(seconds: float) -> bool:
        try:
            await asyncio.wait_for(ctl.watchdog(), seconds)
        except TimeoutError:
            return False
        return True

    assert not asyncio.run(stalls_within(1.2))
    ctl.stepped, ctl.last_progress = True, time.time()
    assert asyncio.run(stalls_within(2.5))
