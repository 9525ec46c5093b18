"""An engine whose connection is gone is named as not connected, at once, in the weight
sync's metadata round: not "no answer within 30 s" after waiting (issue 33, defect 10)."""

from __future__ import annotations

import os
import time

import zmq

from pipeline.weights import WeightHub
from pipeline.weights.control import Link
from pipeline.weights.rounds import meta_round, parse_failure
from pipeline.wire.messages import Hello, WeightMeta


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
