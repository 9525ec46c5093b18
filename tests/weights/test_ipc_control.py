"""The CUDA IPC control flow without a GPU: slot releases are matched per bucket and any
other reply that arrives meanwhile (an engine's WeightDone) is kept for the done round."""

from __future__ import annotations

import time

import pytest
import zmq

from pipeline.errors import WeightSyncError
from pipeline.weights.control import wrap
from pipeline.weights.cuda_ipc import IpcSender
from pipeline.weights.hub import WeightHub
from pipeline.wire import codec
from pipeline.wire.messages import Hello, WeightDone
from pipeline.wire.weights import BucketFree
from tests.weights.wsync_common import free_port


class FakeEngine:
    def __init__(self, hub: WeightHub, name: str, replica: int) -> None:
        self.name = name
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(hub.endpoint)
        self.seq = 0
        self.send(Hello(service=name, replica=replica, pid=0))

    def send(self, body) -> None:
        self.seq += 1
        self.sock.send_multipart(codec.encode(body, run_id="", sender=self.name, seq=self.seq))


@pytest.fixture
def hub():
    h = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    yield h
    h.close()


def test_weight_done_arriving_while_waiting_for_slots_is_kept(hub):
    a, b = FakeEngine(hub, "a", 0), FakeEngine(hub, "b", 1)
    assert hub.wait_for_members(2, 5) == ["a", "b"]
    sender = IpcSender(hub, ["a", "b"], version=4, timeout_s=5)
    a.send(wrap(BucketFree(version=4, bucket=0, slot=0)))
    a.send(wrap(BucketFree(version=4, bucket=1, slot=1)))
    a.send(WeightDone(version=4, engine="a", ok=True))  # a is done before b freed anything
    time.sleep(0.1)
    b.send(wrap(BucketFree(version=4, bucket=0, slot=0)))
    sender.wait_free(0)
    b.send(wrap(BucketFree(version=4, bucket=1, slot=1)))
    sender.wait_free(1)
    b.send(WeightDone(version=4, engine="b", ok=True))
    done = []
    answered = hub.collect(["a", "b"], 2, lambda n, r: done.append(n) or True)
    assert answered == {"a", "b"} and done == ["a", "b"]  # a's early WeightDone was kept
    for engine in (a, b):
        engine.sock.close()


def test_engine_failure_or_silence_while_waiting_for_a_slot_is_named(hub):
    a, b = FakeEngine(hub, "a", 0), FakeEngine(hub, "b", 1)
    hub.wait_for_members(2, 5)
    sender = IpcSender(hub, ["a", "b"], version=2, timeout_s=0.3)
    a.send(wrap(BucketFree(version=2, bucket=0, slot=0)))
    with pytest.raises(WeightSyncError) as info:
        sender.wait_free(0)
    assert info.value.phase == "buckets" and info.value.peer == "b"
    b.send(WeightDone(version=2, engine="b", ok=False, error="buckets: out of memory"))
    with pytest.raises(WeightSyncError, match="out of memory") as info:
        sender.wait_free(0)
    assert info.value.peer == "b"
    for engine in (a, b):
        engine.sock.close()
