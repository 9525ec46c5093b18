"""A worker process that runs user code where a hang or a crash cannot hurt its service.

The service talks to it over a socket pair in msgspec msgpack frames (`rewards.wire`), never
pickle; it is killed by pid on a timeout and started again in place. Reward workers and
environment workers are both this, with their own messages.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pipeline.wire.reward import FrameError, recv_frame, send_frame

MAX_ERROR_CHARS = 500


class ChildTimeout(Exception):
    """The worker gave no answer in time (it is still running the user's code)."""


class ChildLost(Exception):
    """The worker died, broke the stream, or answered out of turn."""


def describe(exc: BaseException) -> str:
    """An exception as one short line (what a worker sends back for user code that raised)."""
    return short(f"{type(exc).__name__}: {exc}")


def short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def child_env() -> dict[str, str]:
    """The worker must import exactly what this process can import (incl. user modules)."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def exit_when_orphaned(parent_pid: int, period_s: float = 0.5) -> None:
    """In the worker: a worker stuck in user code must not outlive a service that died
    without closing it."""

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def worker_socket(fd: int) -> socket.socket:
    """In the worker: its end of the pair; Ctrl-C reaches the whole process group, but the
    service decides when this process ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return socket.socket(fileno=fd)


class ChildWorker:
    """One worker process (`python -m <module> --fd N --parent-pid P <args>`) and our end of
    its socket; restartable in place. Its first frame is a hello of `hello_type`."""

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        decoder: msgspec.msgpack.Decoder[Any],
        hello_type: type,
        startup_timeout_s: float,
    ) -> None:
        self._module = module
        self._args = list(args)
        self._decoder = decoder
        self._hello_type = hello_type
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._hello: Any = None
        self.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        cmd = [sys.executable, "-m", self._module, "--fd", str(child_sock.fileno())]
        cmd += ["--parent-pid", str(os.getpid()), *self._args]
        try:
            self._proc = subprocess.Popen(
                cmd, pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL, env=child_env()
            )
        finally:
            child_sock.close()
        self._sock = parent_sock
        self._hello = None

    def hello(self) -> Any:
        """Wait for the worker to be ready; its startup does not count against any call."""
        if self._hello is None:
            assert self._sock is not None
            deadline = time.monotonic() + self._startup_timeout_s
            try:
                payload = recv_frame(self._sock, deadline)
            except TimeoutError as exc:
                raise ChildLost(f"worker did not start within {self._startup_timeout_s}s") from exc
            except (OSError, FrameError) as exc:
                raise ChildLost(f"worker failed to start: {exc}") from exc
            if payload is None:
                raise ChildLost("worker exited during startup (see its stderr)")
            message = self._decode(payload)
            if not isinstance(message, self._hello_type):
                raise ChildLost(f"worker sent {type(message).__name__} instead of hello")
            self._hello = message
        return self._hello

    def ready(self) -> None:
        """Started (again, after a failed restart) and past its hello (ChildLost if not)."""
        if self._proc is None:
            try:
                self.start()
            except OSError as exc:
                raise ChildLost(f"cannot start a worker: {exc}") from exc
        self.hello()

    def ask(self, payload: bytes, timeout_s: float) -> Any:
        """Send one encoded request and return the decoded reply (ChildTimeout, ChildLost)."""
        self.ready()
        self.send(payload)
        return self.receiver()(time.monotonic() + timeout_s)

    def send(self, payload: bytes) -> None:
        """Send one encoded request (ChildLost when the stream is broken)."""
        assert self._sock is not None
        try:
            send_frame(self._sock, payload)
        except (OSError, FrameError) as exc:
            raise ChildLost(f"worker connection broke: {exc}") from exc

    def receiver(self) -> Callable[[float | None], Any]:
        """A function that reads the next decoded frame, by a monotonic deadline or None
        (ChildTimeout, ChildLost). It is bound to this process's socket: a reader left over
        from before a restart never reads the new process's frames."""
        sock = self._sock
        assert sock is not None

        def receive(deadline: float | None) -> Any:
            try:
                answer = recv_frame(sock, deadline)
            except TimeoutError as exc:
                raise ChildTimeout from exc
            except (OSError, FrameError) as exc:
                raise ChildLost(f"worker connection broke: {exc}") from exc
            if answer is None:
                raise ChildLost("worker process died (crash or exit in user code)")
            return self._decode(answer)

        return receive

    def _decode(self, payload: bytes) -> Any:
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise ChildLost(f"worker sent an undecodable frame: {exc}") from exc

    def drop_socket(self) -> None:
        """Close our end; the worker reads EOF and exits once it is idle."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
            sock.close()

    def kill(self) -> None:
        """SIGKILL by pid and reap, so no zombie and no stuck user code is left behind."""
        self.drop_socket()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def wait_exit(self, deadline: float) -> None:
        """Give the process until `deadline` (monotonic) to exit by itself."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))


def close_workers(workers: Sequence[ChildWorker], grace_s: float = 1.0) -> None:
    """EOF to every worker at once (idle ones exit), then kill whatever is left by pid."""
    for worker in workers:
        worker.drop_socket()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.wait_exit(deadline)
        worker.kill()
