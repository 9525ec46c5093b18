"""Shared fixtures: free endpoints, a temp run directory, process cleanup by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture
def ipc_endpoint(tmp_path: Path):
    def make(name: str) -> str:
        return f"ipc://{tmp_path}/{name}.sock"

    return make


class Procs:
    """Processes started by a test; all killed by pid (group) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], **kw) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.setdefault("PIPELINE_LOG_JSON", "1")
        env.update(kw.pop("env", {}))
        proc = subprocess.Popen(args, env=env, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def python(self, *args: str, **kw) -> subprocess.Popen[bytes]:
        return self.start([sys.executable, *args], **kw)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture
def side():
    """A uvloop on its own thread (tests/transport/loop_thread.py), stopped afterwards."""
    from tests.transport.loop_thread import LoopThread

    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.stop()
