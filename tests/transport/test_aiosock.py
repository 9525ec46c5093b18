"""AsyncSocket: the loop-driven ZeroMQ socket under the queues and the control channel."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from pipeline.transport.channel import make_async_socket


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # also closes what a failed test left open


async def test_receiver_parked_while_the_same_socket_sends_gets_every_echo(ctx, tmp_path):
    """A send on the socket can consume the descriptor signal a parked receiver needs.

    An echo thread answers each message; the client blocks the loop while the echo lands,
    then sends a message that is not echoed: that send processes ZeroMQ's pending commands
    and resets the descriptor, so only the check after the send can wake the receiver.
    """
    endpoint = f"ipc://{tmp_path}/echo.sock"
    server = ctx.socket(zmq.ROUTER)
    server.bind(endpoint)
    n = 20

    stop = threading.Event()

    def echo() -> None:  # owns the server socket: closes it when done or told to stop
        echoed = 0
        while echoed < n and not stop.is_set():
            if not server.poll(50):
                continue
            identity, payload = server.recv_multipart()
            if payload != b"not echoed":
                server.send_multipart([identity, payload])
                echoed += 1
        server.close(linger=0)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = make_async_socket(ctx, zmq.DEALER, identity="c")
    client.connect(endpoint)

    async def receive() -> list[bytes]:
        return [(await client.recv_multipart())[0] for _ in range(n)]

    recv_task = asyncio.create_task(receive())
    try:
        for i in range(n):
            await asyncio.sleep(0.01)  # the receiver is parked
            await client.send_multipart([str(i).encode()])
            time.sleep(0.02)  # the echo lands while the loop is blocked
            await client.send_multipart([b"not echoed"])
        got = await asyncio.wait_for(recv_task, 5)
    finally:
        stop.set()
        thread.join(5)
        client.close(linger=0)
    assert got == [str(i).encode() for i in range(n)]


async def test_send_past_the_high_water_mark_waits_then_goes_through(ctx, tmp_path):
    """EAGAIN on send parks the sender until ZeroMQ signals room (the POLLOUT path)."""
    endpoint = f"ipc://{tmp_path}/late.sock"
    client = make_async_socket(ctx, zmq.DEALER, identity="c")
    client.setsockopt(zmq.SNDHWM, 1)
    client.connect(endpoint)  # nobody bound yet: the pipe holds one message
    await asyncio.wait_for(client.send_multipart([b"0"]), 1)
    send = asyncio.create_task(client.send_multipart([b"1"]))
    await asyncio.sleep(0.2)
    assert not send.done()  # the pipe is full: parked, not spinning, not dropped
    server = make_async_socket(ctx, zmq.ROUTER)
    server.bind(endpoint)
    got = [await asyncio.wait_for(server.recv_multipart(), 5) for _ in range(2)]
    await asyncio.wait_for(send, 5)
    assert got == [[b"c", b"0"], [b"c", b"1"]]
    client.close(linger=0)
    server.close(linger=0)


async def test_poll_times_out_and_close_fails_parked_receivers(ctx, tmp_path):
    sock = make_async_socket(ctx, zmq.DEALER, identity="c")
    sock.connect(f"ipc://{tmp_path}/nobody.sock")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await sock.poll(timeout=150) == 0
    assert loop.time() - t0 >= 0.14
    parked = asyncio.create_task(sock.recv_multipart())
    await asyncio.sleep(0.05)
    sock.close(linger=0)
    with pytest.raises(zmq.ZMQError):
        await asyncio.wait_for(parked, 2)


async def test_receiver_parked_while_a_send_fails_still_wakes(ctx, tmp_path):
    """A send that fails (a ROUTER's message to a peer that is gone: EHOSTUNREACH) also
    processes ZeroMQ's commands and resets the descriptor. A producer resumed after a pause
    heartbeats its dead consumer first: its receiver then never heard the new consumer that
    had connected meanwhile (the chaos test's stall)."""
    endpoint = f"ipc://{tmp_path}/gone.sock"
    server = make_async_socket(ctx, zmq.ROUTER)  # ROUTER_MANDATORY: unknown peers fail
    server.bind(endpoint)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(endpoint)
    try:
        client.send(b"hello")
        assert (await asyncio.wait_for(server.recv_multipart(), 5))[-1] == b"hello"
        parked = asyncio.create_task(server.recv_multipart())
        await asyncio.sleep(0.05)  # the receiver is parked on the descriptor
        client.send(b"after")
        time.sleep(0.2)  # the message lands while the loop is blocked
        with pytest.raises(zmq.ZMQError) as failed:
            await server.send_multipart([b"ghost", b"x"])
        assert failed.value.errno == zmq.EHOSTUNREACH
        assert (await asyncio.wait_for(parked, 2))[-1] == b"after"
    finally:
        client.close(linger=0)
        server.close(linger=0)
