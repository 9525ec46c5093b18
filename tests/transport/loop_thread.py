"""A second event loop on a thread of its own, for tests that stall one side of a link."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


class LoopThread:
    """A uvloop (what every service runs) on a thread of its own."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on this loop; await its result from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def call_blocking(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        """Run `coro` on this loop from a thread (or loop) that may block meanwhile."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stall(self, seconds: float) -> None:
        """Block this loop while it waits for I/O, where a paused process (SIGSTOP) stops
        it: the callback of a descriptor made readable sleeps. On waking, the loop runs the
        timers that came due before it reads what its sockets received meanwhile, as a
        process resumed by SIGCONT does (its ZeroMQ I/O thread has not moved those messages
        in yet); a stall in a ready callback would read the sockets first."""
        read_fd, write_fd = os.pipe()

        def sleep() -> None:
            self.loop.remove_reader(read_fd)
            os.close(read_fd)
            time.sleep(seconds)

        self.loop.call_soon_threadsafe(self.loop.add_reader, read_fd, sleep)
        os.write(write_fd, b"x")
        os.close(write_fd)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
