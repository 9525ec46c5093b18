"""A peer that is alive but whose event loop stalls past the peer timeout (SIGSTOP, a
blocking call) must not cut its delivery link for good (issue 33, defect 11).

Each side runs on its own event loop: the side under test on a second thread, so that a
plain `time.sleep` blocks that loop alone while the other side's keeps running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from pipeline.transport import ChannelConfig, QueueClient, QueueServer
from tests.transport.loop_thread import wait_until
from tests.transport.test_queue_inprocess import prompt

# heartbeats every 0.1 s, dead after 1 s of silence; a stall of 2 s crosses that surely
STALL = ChannelConfig(prefetch=4, max_pending=16, heartbeat_s=0.1, peer_timeout_s=1.0)
STALL_S = 2.0


def live_consumers(server: QueueServer) -> int:
    """Consumers the producer counts as alive (not declared dead)."""
    return len(server._consumers)


async def take(client: QueueClient, n: int, timeout: float) -> list[str]:
    uids = []
    for _ in range(n):
        delivery = await client.get(timeout=timeout)
        uids.append(delivery.uid)
        delivery.ack()
    await asyncio.sleep(0.1)  # the acks go out
    return uids


async def test_consumer_declared_dead_while_stalled_receives_items_again(ipc_endpoint, side):
    """An idle consumer holding all its credit stalls: the producer declares it dead and,
    once it speaks again, takes it back with that credit (it never grants it again)."""
    server = QueueServer(
        "prompts", ipc_endpoint("q"), run_id="r", sender="ctl", config=STALL
    ).start()

    async def make() -> QueueClient:
        return await QueueClient(
            "prompts", [server.endpoint], run_id="r", consumer="roll", config=STALL
        ).start()

    client = await side.call(make())
    try:
        await wait_until(lambda: live_consumers(server) == 1, 5, "the consumer's credit")
        side.stall(STALL_S)
        await wait_until(lambda: server.stats.dead_peers == 1, 5, "the consumer declared dead")
        futures = [await server.send(*prompt(i)) for i in range(3)]
        uids = await side.call(take(client, 3, timeout=5))
        assert sorted(uids) == ["p0", "p1", "p2"]
        await asyncio.wait_for(asyncio.gather(*futures), 5)
        assert live_consumers(server) == 1
        # the consumer's own loop stalled: it does not blame the producer for that
        assert client.stats.dead_peers == 0
    finally:
        await side.call(client.close())
        await server.close()


async def test_server_stalled_past_timeout_keeps_its_live_consumers(ipc_endpoint, side):
    """The producer's loop stalls with items out: on waking it reads the heartbeats that
    wait in its socket instead of declaring the consumer dead and redelivering."""

    async def make() -> QueueServer:
        return QueueServer(
            "prompts", ipc_endpoint("q"), run_id="r", sender="ctl", config=STALL
        ).start()

    server = await side.call(make())
    client = await QueueClient(
        "prompts", [server.endpoint], run_id="r", consumer="roll", config=STALL
    ).start()

    async def send(first: int, n: int) -> list[concurrent.futures.Future[None]]:
        return [await server.send(*prompt(i)) for i in range(first, first + n)]

    try:
        await side.call(send(0, 2))
        held = [await client.get(timeout=5) for _ in range(2)]  # in flight, not acked

        async def counters() -> tuple[int, int, int]:
            return server.stats.dead_peers, server.stats.redelivered, live_consumers(server)

        # twice: a message that reaches the socket just as a stall begins is read before
        # the liveness check runs (the old code got through one stall so, rarely)
        for _ in range(2):
            await asyncio.sleep(0.3)  # the credit the gets returned has been read
            side.stall(STALL_S)
            await asyncio.sleep(STALL_S + 10 * STALL.heartbeat_s)  # woken, ticks on
            assert await side.call(counters()) == (0, 0, 1)
        for delivery in held:
            delivery.ack()
        await side.call(send(2, 3))
        assert sorted(await take(client, 3, timeout=5)) == ["p2", "p3", "p4"]
        await wait_until(lambda: server.unacked == 0, 5, "every item acknowledged")
        assert client.stats.duplicates == 0
    finally:
        await client.close()
        await side.call(server.close())
