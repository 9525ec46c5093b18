"""One service replica restarted as `pipeline run` restarts it, for a launcher that starts
each replica on its own: a Slurm step runs `pipeline service ROLE --supervise ...`.

The rules are the local supervisor's (`runtime/supervisor.py`). A service that crashed or
was killed starts again after RESTART_BACKOFF_S, at most `supervisor.max_restarts` times
within RESTART_WINDOW_S. One that refused its config (EXIT_CONFIG) does not: a restart
would refuse it again. A controller starts again only when a signal killed it (it resumes
the run from its journal); one that exits with a code of its own has ended the run. A
service that exits 0 is done. Once the controller has ended the run (summary.json), a
replica that it did not tell to stop (restarted too late to join the end) is stopped, as
at the end of a local run. SIGTERM or SIGINT stops the service and the loop.

Every start and exit is written to RUN/supervisor/ROLE-REPLICA.json with this process's
pid and the service's: how an operator (or a test) finds the service process of a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.log import get_logger
from pipeline.runtime import layout
from pipeline.runtime.restart_budget import RestartBudget, restartable
from pipeline.runtime.supervisor import RESTART_BACKOFF_S, RESTART_WINDOW_S, run_end

# seconds between looks at the run's end while the service runs
POLL_S = 0.5


class ReplicaSupervisor:
    def __init__(
        self, config: PipelineConfig, role: str, replica: int, service_argv: list[str]
    ) -> None:
        self.role = role
        self.name = f"{role}-{replica}"
        self.run_dir = layout.run_dir(config)
        self.record_path = self.run_dir / "supervisor" / f"{self.name}.json"
        self.argv = [sys.executable, "-m", config.service_module(role), *service_argv]
        self.budget = RestartBudget(config.supervisor.max_restarts, RESTART_WINDOW_S)
        self.stop_timeout_s = config.supervisor.stop_timeout_s
        self.log = get_logger("supervisor")
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # wall time of the live service's start
        self.began = time.time()  # an earlier summary.json is a previous job's
        self.stop_signal: int | None = None
        self.stopped_at: float | None = None  # monotonic time of the SIGTERM
        self.restarts = 0
        self.events: list[dict[str, Any]] = []

    def run(self) -> int:
        """Run the replica until it is done, failed for good, or stopped; its exit code
        (128 + the signal where a signal killed it)."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            while True:
                self._start()
                code = self._wait()
                self._event(exit=code)
                if self.stop_signal is not None or self.stopped_at is not None:
                    return _shell_code(code)
                if not restartable(self.role, code):
                    if code != 0:
                        self.log.error("service_failed", service=self.name, code=code)
                    return _shell_code(code)
                if not self.budget.take(time.monotonic()):
                    self.log.error(
                        "service_failed",
                        service=self.name,
                        code=code,
                        restarts=self.restarts,
                        within_s=RESTART_WINDOW_S,
                    )
                    return _shell_code(code)
                self.restarts += 1
                self.log.warning(
                    "service_restarting", service=self.name, code=code, attempt=self.restarts
                )
                time.sleep(RESTART_BACKOFF_S)
                if self.stop_signal is not None:
                    return _shell_code(code)
        finally:
            self._kill()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.argv, start_new_session=True)
        self.started_at = time.time()
        self.log.info("service_started", service=self.name, pid=self.proc.pid)
        self._event(started=self.proc.pid)

    def _wait(self) -> int:
        """Wait for the service to exit; stop it once the run has ended without it."""
        assert self.proc is not None
        while True:
            try:
                return self.proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if self.stopped_at is None and self.role != "controller" and self._left_out():
                self.log.info("service_not_in_run", service=self.name, pid=self.proc.pid)
                self._signal(signal.SIGTERM)
            if (
                self.stopped_at is not None
                and time.monotonic() - self.stopped_at > self.stop_timeout_s
            ):
                self.log.warning("service_killed", service=self.name, pid=self.proc.pid)
                self._signal(signal.SIGKILL)

    def _left_out(self) -> bool:
        ended = run_end(self.run_dir)
        if ended is None or ended.told_at < self.began:
            return False
        return not ended.told(self.name, self.started_at)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stop_signal = signum
        self._signal(signal.SIGTERM)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if sig == signal.SIGTERM and self.stopped_at is None:
            self.stopped_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def _kill(self) -> None:
        """Leave no service behind (an exception in the loop, a signal during the
        backoff): SIGTERM, then SIGKILL after the deadline."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._event(exit=self.proc.returncode)

    def _event(self, **fields: int) -> None:
        self.events.append({"time": time.time(), **fields})
        live = self.proc is not None and self.proc.poll() is None
        record = {
            "service": self.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "service_pid": self.proc.pid if live and self.proc is not None else None,
            "restarts": self.restarts,
            "events": self.events,
        }
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.record_path.with_suffix(".json.partial")
        partial.write_text(json.dumps(record, indent=2))
        os.replace(partial, self.record_path)


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def supervise_replica(
    config: PipelineConfig, role: str, replica: int, service_argv: list[str]
) -> int:
    """`pipeline service ROLE --supervise`: the replica under its restart loop."""
    return ReplicaSupervisor(config, role, replica, service_argv).run()
