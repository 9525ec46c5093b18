"""An engine whose connection is gone is named as not connected, at once, in the weight
sync's metadata round: not "no answer within 30 s" after waiting (issue 33, defect 10)."""

from __future__ import annotations

import os
import threading
import time

import zmq

from pipeline.weights import WeightHub
from pipeline.weights.control import Link
from pipeline.weights.rounds import meta_round, parse_failure
from pipeline.wire.messages import Hello, WeightMeta
from tests.transport.refusal import curve_refuser, until_refused_blocking


def test_an_engine_that_left_is_named_not_connected_without_waiting():
    hub = WeightHub(endpoint="tcp://127.0.0.1:0")
    ctx = zmq.Context()
    engine = Link(ctx, zmq.DEALER, sender="engine-0", identity="engine-0")
    engine.sock.connect(hub.endpoint)
    engine.send(Hello(service="engine-0", replica=0, pid=os.getpid()))
    hub.poll(2.0)
    assert hub.names() == ["engine-0"]
    engine.sock.close(linger=0)
    time.sleep(0.5)  # the ROUTER sees the disconnect
    meta = WeightMeta(version=3, entries=[], bucket_sizes=[], transport="gloo")
    start = time.monotonic()
    failure = parse_failure(meta_round(hub, ["engine-0"], meta, timeout_s=30.0))
    assert time.monotonic() - start < 5.0
    assert failure.phase == "meta" and failure.peer == "engine-0"
    assert "not connected" in failure.detail and "no answer" not in failure.detail
    assert hub.names() == []
    ctx.term()


def test_an_engine_whose_connection_the_hub_refused_is_not_stuck_in_a_send():
    """A hub that demands CURVE drops an engine without keys at the greeting, and libzmq
    does not retry: the engine's socket has no peer left. Its hello (and its goodbye at
    close) must not wait for one for ever: the send says 0, not connected."""
    ctx = zmq.Context()
    hub, endpoint = curve_refuser(ctx)
    engine = Link(ctx, zmq.DEALER, sender="engine-0", identity="engine-0")
    engine.sock.connect(endpoint)
    until_refused_blocking(engine.sock)
    sent: list[int] = []
    hello = Hello(service="engine-0", replica=0, pid=os.getpid())
    sender = threading.Thread(target=lambda: sent.append(engine.send(hello)), daemon=True)
    sender.start()
    sender.join(5)
    assert sent == [0], "the engine's send waited for a peer"
    engine.close()
    hub.close()
    ctx.term()
