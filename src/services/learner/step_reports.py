"""The learner's reports to the controller, kept until the controller has them.

Accounting hangs on them: a StepDone settles its uids as trained, a Dropped as dropped
(and makes the controller release replacements). A controller killed between a send and
its journal would lose them, so a StepDone stays here until the controller's heartbeats
announce its policy version (the controller journals a step before it announces the
version). Whenever the control client rejoins a new controller incarnation, everything
unconfirmed goes again, with the stale drops of the step being collected; the controller
ignores what it already has, so a report sent twice is harmless.
"""

from __future__ import annotations

import asyncio
import time

from pipeline.log import get_logger
from pipeline.transport import ControlClient
from pipeline.wire.messages import Dropped, StepDone


class StepReports:
    def __init__(self, control: ControlClient, *, resend_after_s: float = 30.0) -> None:
        self.control = control
        # a safety net: an unconfirmed step goes again this long after it was sent
        self.resend_after_s = resend_after_s
        self.pending: list[tuple[StepDone, float]] = []
        self.stale: list[str] = []  # sample uids dropped since the last StepDone
        self._stale_version = 0
        self._rejoins = control.rejoins
        self._lock = asyncio.Lock()
        self.log = get_logger("step_reports")

    async def dropped(self, uids: list[str], policy_version: int) -> None:
        async with self._lock:
            self.stale.extend(uids)
            self._stale_version = policy_version
            await self.control.send(Dropped(uids=uids, policy_version=policy_version))

    async def step_done(self, done: StepDone) -> None:
        """Report a step; it carries the step's stale drops, so those are settled too."""
        async with self._lock:
            self.stale = []
            self.pending.append((done, time.monotonic()))
            if not await self._after_rejoin():
                await self.control.send(done)

    async def watch(self) -> None:
        """Re-send after a controller restart; run as a task for the service's life."""
        while True:
            await asyncio.sleep(self.control.config.heartbeat_s)
            async with self._lock:
                if await self._after_rejoin():
                    continue
                self._confirm()
                if self.pending and time.monotonic() - self.pending[0][1] > self.resend_after_s:
                    await self._send_all("unconfirmed")

    def _confirm(self) -> None:
        known = self.control.controller_version
        self.pending = [(d, t) for d, t in self.pending if d.policy_version > known]

    async def _after_rejoin(self) -> bool:
        """Everything unconfirmed again if a new controller incarnation answered since."""
        if self.control.rejoins == self._rejoins:
            return False
        self._rejoins = self.control.rejoins
        self._confirm()
        await self._send_all("controller_restarted")
        return True

    async def _send_all(self, reason: str) -> None:
        if self.stale:
            await self.control.send(Dropped(uids=self.stale, policy_version=self._stale_version))
        now = time.monotonic()
        self.pending = [(d, now) for d, _ in self.pending]
        for done, _ in self.pending:
            await self.control.send(done)
        if self.pending or self.stale:
            self.log.info(
                "reports_sent_again",
                reason=reason,
                steps=[d.step for d, _ in self.pending],
                dropped=len(self.stale),
            )
