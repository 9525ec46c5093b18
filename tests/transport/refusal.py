"""A server that refuses every client, and the wait until a client's socket knows it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq

_WAIT_S = 10.0


def curve_refuser(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A CURVE server on loopback (a controller or hub on another host met without keys),
    and its endpoint."""
    public, secret = zmq.curve_keypair()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, secret, public
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


async def until_refused(sock: Any) -> None:
    """Until a connected AsyncSocket has no peer left: its server refused the greeting, and
    libzmq does not connect again."""
    deadline = time.monotonic() + _WAIT_S
    while await sock.poll(timeout=0, flags=zmq.POLLOUT):
        assert time.monotonic() < deadline, "the server never refused the client"
        await asyncio.sleep(0.02)


def until_refused_blocking(sock: zmq.Socket) -> None:
    """`until_refused` for a plain socket."""
    deadline = time.monotonic() + _WAIT_S
    while sock.poll(0, zmq.POLLOUT):
        assert time.monotonic() < deadline, "the server never refused the client"
        time.sleep(0.02)
