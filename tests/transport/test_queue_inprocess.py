"""Credit, ack, redelivery and de-duplication of one queue, driven in one process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq.asyncio
from structlog.testing import capture_logs

from pipeline.transport import ChannelConfig, QueueClient, QueueServer, security
from pipeline.wire.codec import TensorPack
from pipeline.wire.messages import Prompt
from tests.transport.refusal import until_refused

FAST = ChannelConfig(prefetch=4, max_pending=8, heartbeat_s=0.05, peer_timeout_s=0.5)


def prompt(i: int) -> tuple[Prompt, TensorPack]:
    pack = TensorPack()
    ref = pack.add(np.arange(i % 7 + 1, dtype=np.int32))
    return Prompt(uid=f"p{i}", prompt_ids=ref, n_samples=2), pack


async def test_items_flow_with_tensors_and_acks(ipc_endpoint):
    server = QueueServer(
        "prompts", ipc_endpoint("q"), run_id="r", sender="ctl", config=FAST
    ).start()
    client = await QueueClient(
        "prompts", [server.endpoint], run_id="r", consumer="roll", config=FAST
    ).start()
    seen = []

    async def consume() -> None:
        for _ in range(20):
            d = await client.get(timeout=5)
            arr = d.message.tensor(d.body.prompt_ids)
            assert arr.tolist() == list(range(int(d.uid[1:]) % 7 + 1))
            seen.append(d.uid)
            d.ack()

    consumer = asyncio.create_task(consume())
    futures = [await server.send(*prompt(i)) for i in range(20)]
    await asyncio.wait_for(consumer, 10)
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert sorted(seen) == sorted(f"p{i}" for i in range(20))
    assert server.unacked == 0
    await client.close()
    await server.close()


async def test_no_credit_no_send(ipc_endpoint):
    server = QueueServer(
        "prompts", ipc_endpoint("q"), run_id="r", sender="ctl", config=FAST
    ).start()
    client = await QueueClient(
        "prompts", [server.endpoint], run_id="r", consumer="roll", config=FAST
    ).start()
    for i in range(12):
        await server.send(*prompt(i))
    await asyncio.sleep(0.3)
    # prefetch=4: the consumer holds 4, the producer keeps the rest
    assert client.buffered == 4
    assert server.pending == 8
    assert server.stats.sent == 4
    # the queue is full (max_pending=8): a 13th send waits
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(server.send(*prompt(99)), 0.3)
    await client.close()
    await server.close()


async def test_dead_consumer_items_redelivered_once(ipc_endpoint):
    server = QueueServer(
        "prompts", ipc_endpoint("q"), run_id="r", sender="ctl", config=FAST
    ).start()
    first = await QueueClient(
        "prompts", [server.endpoint], run_id="r", consumer="a", config=FAST
    ).start()
    for i in range(6):
        await server.send(*prompt(i))
    got = [await first.get(timeout=5) for _ in range(3)]
    got[0].ack()
    await asyncio.sleep(0.1)
    await first.close()  # dies without acking 2 of its items (and 1 prefetched)
    second = await QueueClient(
        "prompts", [server.endpoint], run_id="r", consumer="b", config=FAST
    ).start()
    uids = []
    for _ in range(5):
        d = await second.get(timeout=5)
        uids.append(d.uid)
        d.ack()
    assert sorted([*uids, got[0].uid]) == sorted(f"p{i}" for i in range(6))
    assert server.stats.redelivered >= 2
    await second.close()
    await server.close()


async def test_duplicate_uid_is_acked_not_surfaced(ipc_endpoint):
    server = QueueServer(
        "prompts", ipc_endpoint("q"), run_id="r", sender="ctl", config=FAST
    ).start()
    client = await QueueClient(
        "prompts", [server.endpoint], run_id="r", consumer="a", config=FAST
    ).start()
    client.mark_done(["p1"])
    fut = await server.send(*prompt(1))
    await server.send(*prompt(2))
    d = await client.get(timeout=5)
    assert d.uid == "p2"
    await asyncio.wait_for(fut, 5)  # the duplicate was acknowledged without surfacing
    assert client.stats.duplicates == 1
    await client.close()
    await server.close()


async def test_a_producer_that_refused_the_consumer_neither_stalls_it_nor_the_others():
    """Two producers; the run's secret differs at one of them (as keys that differ between
    hosts would), so it refuses the consumer's connection, which libzmq does not retry. The
    consumer's start must not wait on that producer's credit for ever: it says which one
    refused it, and takes the other one's items."""
    contexts = [zmq.asyncio.Context(), zmq.asyncio.Context()]  # each its own ZAP handler
    servers = []
    for ctx, name, secret in zip(
        contexts, ("ctl", "ctl-1"), ("the run's", "another run's"), strict=True
    ):
        security.configure(None, run_secret=secret)
        servers.append(
            QueueServer(
                "prompts", "tcp://127.0.0.1:0", run_id="r", sender=name, config=FAST, ctx=ctx
            ).start()
        )
    server, refusing = servers
    security.configure(None, run_secret="the run's")
    client = QueueClient(
        "prompts", [refusing.endpoint, server.endpoint], run_id="r", consumer="roll", config=FAST
    )
    try:
        # refused while the service still sets up, before its first credit goes out
        await until_refused(client._producers[0].sock)
        with capture_logs() as logs:
            await asyncio.wait_for(client.start(), 5)
            for i in range(6):
                await server.send(*prompt(i))
            taken = [await client.get(timeout=5) for _ in range(6)]
            for delivery in taken:
                delivery.ack()
            await asyncio.sleep(0.3)  # heartbeats and acks go out; none to the refusing one
        assert sorted(d.uid for d in taken) == [f"p{i}" for i in range(6)]
        refused = [r for r in logs if r["event"] == "producer_refused"]
        assert len(refused) == 1 and refused[0]["endpoint"] == refusing.endpoint
        assert refused[0]["reason"] == "bad_credentials"
        assert not [r for r in logs if r["event"] == "receive_failed"]
    finally:
        security.configure(None)
        await client.close()
        for ctx, queue_server in zip(contexts, servers, strict=True):
            await queue_server.close()
            security.release(ctx)
            ctx.term()
