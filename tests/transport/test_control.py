"""Handshake with a time limit; a dead peer becomes visible instead of a silent hang."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from pipeline.errors import HandshakeRefused, HandshakeTimeout
from pipeline.log import get_logger
from pipeline.transport import ChannelConfig, ControlClient, ControlServer, security
from pipeline.transport.control import PeerEvent
from pipeline.wire.messages import ConfigMsg, Hello, StepDone
from tests.transport.refusal import curve_refuser, until_refused

FAST = ChannelConfig(heartbeat_s=0.05, peer_timeout_s=0.4)


def hello(name: str = "rollout") -> Hello:
    return Hello(service=name, replica=0, pid=os.getpid())


def answer(h: Hello) -> ConfigMsg:
    return ConfigMsg(run_id="run1", run_dir="/tmp/x", config_json="{}", policy_version=3)


async def test_handshake_times_out_without_controller(ipc_endpoint):
    client = ControlClient(ipc_endpoint("nobody"), service="rollout", replica=0, config=FAST)
    start = time.monotonic()
    with pytest.raises(HandshakeTimeout, match="did not answer hello"):
        await client.handshake(hello(), timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    await client.close()


async def test_a_refused_connection_ends_the_handshake_at_once_with_the_reason():
    """A controller that demands CURVE drops a client without keys at the ZMTP greeting,
    and libzmq does not retry: the client's socket is left without a peer, so even its
    hello cannot be sent. Refused before the hello went out, the handshake says so at once
    (it waited on that send without end)."""
    ctx = zmq.Context()
    controller, endpoint = curve_refuser(ctx)
    client = ControlClient(endpoint, service="reward", replica=1, config=FAST)
    try:
        await until_refused(client._sock)
        start = time.monotonic()
        with pytest.raises(HandshakeRefused, match=r"refused .*\(wrong_mechanism\).*keys_dir"):
            await asyncio.wait_for(client.handshake(hello("reward"), timeout_s=30), 10)
        assert time.monotonic() - start < 2.0
    finally:
        await client.close()
        controller.close()
        ctx.term()


@pytest.mark.parametrize(
    ("secret", "refused"),
    [("the-run's", None), ("another run's", "bad_credentials")],
)
async def test_the_controller_on_its_host_refuses_a_service_without_the_run_secret(secret, refused):
    """The run's own ControlServer, PLAIN with the run's secret on a loopback address: a
    service with another secret is told at once why; one with it joins. (Without any
    secret the mechanisms differ, and which side notices first is a race: when the
    controller does, the client connects again and the time limit ends its handshake.)"""
    ctx = zmq.asyncio.Context()
    security.configure(None, run_secret="the-run's")
    server = ControlServer("tcp://127.0.0.1:0", run_id="run1", config_for=answer, ctx=ctx)
    server.start()
    security.configure(None, run_secret=secret)
    client = ControlClient(server.endpoint, service="reward", replica=0, config=FAST)
    try:
        start = time.monotonic()
        if refused is None:
            assert (await client.handshake(hello("reward"), timeout_s=30)).run_id == "run1"
        else:
            with pytest.raises(HandshakeRefused, match=rf"\({refused}\)"):
                await asyncio.wait_for(client.handshake(hello("reward"), timeout_s=30), 10)
        assert time.monotonic() - start < 2.0
    finally:
        security.configure(None)
        await client.close()
        await server.close()
        security.release(ctx)
        ctx.term()


async def test_handshake_then_reports_then_dead_peers_both_ways(ipc_endpoint):
    server = ControlServer(ipc_endpoint("ctl"), run_id="run1", config_for=answer, config=FAST)
    server.start()
    client = ControlClient(server.endpoint, service="learner", replica=0, config=FAST)
    config = await client.handshake(hello("learner"), timeout_s=5)
    assert (config.run_id, client.policy_version) == ("run1", 3)
    events = [await asyncio.wait_for(server.inbox.get(), 2) for _ in range(2)]
    assert [e.kind for e in events if isinstance(e, PeerEvent)] == ["joined", "ready"]
    await client.send(StepDone(step=0, policy_version=1, trained_uids=["a/0"]))
    peer, body = await asyncio.wait_for(server.inbox.get(), 2)
    assert isinstance(body, StepDone) and peer.name == "learner-0"
    # the service goes silent: the controller reports it dead
    await client.close()
    event = await asyncio.wait_for(server.inbox.get(), 3)
    assert isinstance(event, PeerEvent) and event.kind == "dead"
    # the controller goes silent: the service marks it dead and says so
    get_logger("tests")  # configure logging first: configuring inside would drop the capture
    with capture_logs() as logs:
        client2 = ControlClient(server.endpoint, service="reward", replica=1, config=FAST)
        await client2.handshake(hello("reward"), timeout_s=5)
        await server.close()
        await asyncio.wait_for(client2.controller_dead.wait(), 3)
    silent = [e for e in logs if e["event"] == "controller_silent"]
    assert [e["log_level"] for e in silent] == ["warning"]
    assert silent[0]["silent_s"] >= FAST.peer_timeout_s  # rounded to 0.1 s
    await client2.close()


async def test_a_peer_declared_dead_while_busy_is_taken_back_when_it_speaks(ipc_endpoint):
    """A service whose loop stalled past peer_timeout_s (a model load) is not lost for good."""
    import zmq

    from pipeline.transport.channel import make_async_socket
    from pipeline.wire import codec
    from pipeline.wire.messages import Heartbeat

    server = ControlServer(ipc_endpoint("ctl"), run_id="run1", config_for=answer, config=FAST)
    server.start()
    sock = make_async_socket(zmq.Context.instance(), zmq.DEALER, identity="slow-0")
    sock.connect(server.endpoint)
    await sock.send_multipart(codec.encode(hello("learner"), run_id="", sender="slow", seq=1))
    reply = codec.decode(await asyncio.wait_for(sock.recv_multipart(copy=False), 2))
    assert isinstance(reply.body, ConfigMsg)
    event = await asyncio.wait_for(server.inbox.get(), 2)
    assert isinstance(event, PeerEvent) and event.kind == "joined"
    event = await asyncio.wait_for(server.inbox.get(), 3)  # silent past peer_timeout_s
    assert isinstance(event, PeerEvent) and event.kind == "dead"
    assert server.peers == {}
    beat = Heartbeat(service="learner", policy_version=7)
    await sock.send_multipart(codec.encode(beat, run_id="run1", sender="slow", seq=2))
    event = await asyncio.wait_for(server.inbox.get(), 2)
    assert isinstance(event, PeerEvent) and event.kind == "back" and event.peer.name == "learner-0"
    answer_beat = codec.decode(await asyncio.wait_for(sock.recv_multipart(copy=False), 2))
    assert isinstance(answer_beat.body, Heartbeat)  # answered, not rejected as "before hello"
    assert server.stats.rejected["no_hello"] == 0
    assert [p.policy_version for p in server.peers.values()] == [7]
    sock.close(linger=0)
    await server.close()


async def test_services_rejoin_a_restarted_controller_at_the_same_address(ipc_endpoint):
    """A new controller incarnation does not know the running services; they say hello to
    it on their own, and its heartbeats then acknowledge the learner's version."""
    endpoint = ipc_endpoint("ctl")
    first = ControlServer(endpoint, run_id="run1", config_for=answer, config=FAST).start()
    client = ControlClient(first.endpoint, service="learner", replica=0, config=FAST)
    await client.handshake(hello("learner"), timeout_s=5)
    assert (client.rejoins, client.controller_version) == (0, 3)
    await first.close()  # the controller dies

    second = ControlServer(endpoint, run_id="run1", config_for=answer, config=FAST)
    second.policy_version = 5  # what its journal says the learner reached
    second.start()
    deadline = time.monotonic() + 5
    while client.rejoins == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert client.rejoins == 1
    kinds = []
    while len(kinds) < 2:
        event = await asyncio.wait_for(second.inbox.get(), 2)
        kinds.append(event.kind)
    assert kinds == ["joined", "ready"]
    assert [p.name for p in second.peers.values() if p.ready] == ["learner-0"]
    await asyncio.sleep(3 * FAST.heartbeat_s)
    assert client.controller_version == 5 and client.policy_version >= 5
    # from now on reports reach the new incarnation
    await client.send(StepDone(step=5, policy_version=6, trained_uids=["a/0"]))
    peer, body = await asyncio.wait_for(second.inbox.get(), 2)
    assert isinstance(body, StepDone) and peer.name == "learner-0"
    assert client.rejoins == 1  # one hello per incarnation
    await client.close()
    await second.close()
