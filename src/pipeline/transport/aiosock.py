"""A ZeroMQ socket driven by the running event loop, without a Future per message.

`zmq.asyncio` creates and resolves a Future for every send and receive and re-reads the
socket's events through several enum conversions each time; at thousands of messages per
second that Python work competes with ZeroMQ's own I/O thread for the cores (it cost about a
third of the 1 MiB throughput on two cores). Here every send and receive first tries the
operation without blocking and only waits on the socket's file descriptor when ZeroMQ says
EAGAIN.

ZeroMQ's descriptor signals that the socket has internal commands to process, not that a
message is readable, and any operation on the socket may process (and so consume) that
signal. So: the descriptor's callback re-reads `EVENTS` and wakes the waiters whose
condition now holds, and after every operation, whatever its outcome, the same check runs
while anyone waits on the other side (a send can swallow the signal a parked receiver
needed, a send that fails too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import zmq


class AsyncSocket:
    """Awaitable send/recv/poll over a plain `zmq.Socket`; other attributes pass through."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._readers: list[asyncio.Future[None]] = []
        self._writers: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def __getattr__(self, name: str) -> Any:  # bind, connect, setsockopt, closed, ...
        return getattr(self.sock, name)

    # ----------------------------------------------------------------- operations

    async def recv_multipart(self, copy: bool = True) -> list[Any]:
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                pass
            finally:
                self._recheck(self._writers)
            await self._wait(self._readers)

    async def send_multipart(self, frames: Sequence[Any], copy: bool = True) -> None:
        while True:
            try:
                # with SNDHWM 0 only a DEALER without peers says EAGAIN, and ZeroMQ takes
                # the later parts of a message whose first part it took
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                return
            except zmq.Again:
                pass
            finally:
                self._recheck(self._readers)
            await self._wait(self._writers)

    async def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        """Like `zmq.Socket.poll` (timeout in ms, None = forever); returns the events set."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout / 1000
        waiters = self._readers if flags & zmq.POLLIN else self._writers
        while True:
            events = self._events()  # wakes the other side's waiters it may concern
            if events & flags:
                return int(events & flags)
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return 0
            try:
                await asyncio.wait_for(self._wait(waiters), left)
            except TimeoutError:
                return 0

    def close(self, linger: int | None = None) -> None:
        if self._loop is not None and not self.sock.closed:
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # loop closed already
                self._loop.remove_reader(self.sock.FD)
        self.sock.close(linger=linger)
        self._wake_all(self._readers, zmq.ZMQError(zmq.ENOTSOCK))
        self._wake_all(self._writers, zmq.ZMQError(zmq.ENOTSOCK))

    # ----------------------------------------------------------------- waiting

    async def _wait(self, waiters: list[asyncio.Future[None]]) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self.sock.FD, self._check)
        fut = loop.create_future()
        waiters.append(fut)
        try:
            await fut
        finally:
            if fut in waiters:  # cancelled
                waiters.remove(fut)

    def _recheck(self, others: list[asyncio.Future[None]]) -> None:
        """After any operation, a failed one too (EAGAIN, a ROUTER's EHOSTUNREACH): it may
        have consumed the descriptor signal that the other side's waiters need."""
        if others:
            self._check()

    def _check(self) -> None:
        """Re-read the socket's events (this also resets its descriptor) and wake waiters."""
        with contextlib.suppress(zmq.ZMQError):  # the waiters got it
            self._events()

    def _events(self) -> int:
        """The socket's events, with every waiter whose condition holds woken (reading them
        resets the descriptor); a socket that fails fails its waiters too."""
        try:
            if self.sock.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK)
            events = int(self.sock.getsockopt(zmq.EVENTS))
        except zmq.ZMQError as exc:
            self._wake_all(self._readers, exc)
            self._wake_all(self._writers, exc)
            raise
        if events & zmq.POLLIN and self._readers:
            self._wake_all(self._readers)
        if events & zmq.POLLOUT and self._writers:
            self._wake_all(self._writers)
        return events

    @staticmethod
    def _wake_all(waiters: list[asyncio.Future[None]], exc: Exception | None = None) -> None:
        pending, waiters[:] = list(waiters), []
        for fut in pending:
            if fut.done():
                continue
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
