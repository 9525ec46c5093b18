"""Learner and engines in one process (engines in threads): bitwise round trips, refused
metadata, and the per-phase deadlines, without the cost of starting processes."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from pipeline.engines.weights import SafePoint
from pipeline.errors import WeightSyncError
from pipeline.models import CausalLM
from pipeline.weights import (
    MIB,
    PublishConfig,
    SyncTimeouts,
    WeightHub,
    WeightPublisher,
    WeightReceiver,
)
from pipeline.weights import config as deadlines
from pipeline.weights.validate import ParamSpec
from pipeline.wire import codec
from pipeline.wire.messages import Hello
from tests.weights.wsync_common import (
    ROLLOUT_DTYPE,
    TINY,
    assert_engine_equal,
    free_port,
    shard_specs,
    wait_for,
)

FAST = SyncTimeouts(bucket_timeout_s=2, apply_timeout_s=5)
FAST_META_S = 1.0


@pytest.fixture(autouse=True)
def fast_deadlines(monkeypatch):
    """The group's and the metadata's deadlines (module constants), short here."""
    monkeypatch.setattr(deadlines, "GROUP_TIMEOUT_S", 5.0)
    monkeypatch.setattr(deadlines, "META_TIMEOUT_S", FAST_META_S)


class Engine:
    """A receiver thread plus the weights it serves (stopped at teardown by `hub`)."""

    def __init__(self, hub, name, specs, *, tp_rank=0, tp_size=1, apply=None, version=-1):
        hub.test_engines.append(self)
        self.serving = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
        self.applied: list[int] = []
        self.receiver = WeightReceiver(
            name,
            hub.endpoint,
            specs,
            apply or self.load,
            tp_rank=tp_rank,
            tp_size=tp_size,
            timeouts=FAST,
            version=version,
        )
        self.receiver.start()

    def load(self, tensors, version):
        for n, t in tensors.items():
            self.serving[n].copy_(t)
        self.applied.append(version)


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = CausalLM(TINY)
    m.init_weights(std=0.2)
    return m


@pytest.fixture
def hub():
    h = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    h.test_engines = []
    yield h
    for engine in h.test_engines:
        engine.receiver.stop()
    h.close()


def _expected(model):
    return {n: p.detach().to(ROLLOUT_DTYPE) for n, p in model.named_parameters()}


def _bump(model, step=0.01):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 2048, 100], ids=str)
def test_roundtrip_bitwise_with_tp_and_split_tensors(model, hub, bucket_bytes):
    engines = [
        Engine(hub, "e0", shard_specs(0, 1)),
        Engine(hub, "e1.tp0", shard_specs(0, 2), tp_rank=0, tp_size=2),
        Engine(hub, "e1.tp1", shard_specs(1, 2), tp_rank=1, tp_size=2),
    ]
    assert len(hub.wait_for_members(3, 10)) == 3
    config = PublishConfig(bucket_mb=bucket_bytes / MIB, timeouts=FAST)
    publisher = WeightPublisher(model, hub=hub, config=config)
    for version in (1, 2):
        _bump(model)
        report = publisher.publish(version)
        assert report.bytes == publisher.plan.total_bytes and report.gbps > 0
        for e, (r, t) in zip(engines, [(0, 1), (0, 2), (1, 2)], strict=True):
            assert e.applied[-1] == version and e.receiver.version == version
            assert_engine_equal(_expected(model), e.serving, r, t)
        # resharded: a TP rank receives its shards only (the replicated norms come whole)
        full, half = (e.receiver.received_bytes for e in engines[:2])
        assert full == publisher.plan.total_bytes
        assert engines[2].receiver.received_bytes == half
        shards = sum(t.numel() * t.element_size() for t in engines[1].serving.values())
        assert shards <= half < full * 0.6, (shards, half, full)


def test_bad_metadata_is_refused_with_every_name_and_old_version_keeps_serving(model, hub):
    good = Engine(hub, "good", shard_specs(0, 1))
    hub.wait_for_members(1, 10)
    publisher = WeightPublisher(model, hub=hub, config=PublishConfig(timeouts=FAST))
    publisher.publish(1)
    v1 = {n: t.clone() for n, t in good.serving.items()}

    specs = shard_specs(0, 1)
    del specs["model.norm.weight"]  # the learner sends it: unknown to this engine
    specs["model.extra.weight"] = ParamSpec((4,), ROLLOUT_DTYPE)  # never sent: missing
    specs["lm_head.weight"] = ParamSpec((95, 31), ROLLOUT_DTYPE)  # mis-shaped
    specs["model.layers.0.mlp.up_proj.weight"] = ParamSpec((48, 31), torch.float16)  # dtype
    bad = Engine(hub, "bad", specs, version=0)
    hub.wait_for_members(2, 10)
    _bump(model)
    with pytest.raises(WeightSyncError) as info:
        publisher.publish(2)
    err = info.value
    assert err.phase == "meta" and err.peer == "bad"
    for name in (
        "model.norm.weight",
        "model.extra.weight",
        "lm_head.weight",
        "model.layers.0.mlp.up_proj.weight",
    ):
        assert name in str(err)
    for kind in ("unknown", "missing", "shape", "dtype"):
        assert f"{kind}:" in str(err)
    # nothing moved: both engines keep serving what they had
    assert bad.receiver.version == 0 and bad.applied == []
    assert all(not t.any() for t in bad.serving.values())
    assert good.receiver.version == 1 and good.applied == [1]
    assert all(torch.equal(v1[n], t) for n, t in good.serving.items())
    # the refusing engine is dropped; the run goes on without it
    report = publisher.publish(2)
    assert report.engines == ["good"]
    assert good.receiver.version == 2 and bad.receiver.version == 0
    assert "missing: model.extra.weight" in bad.receiver.last_error


def test_apply_timeout_fails_the_update_and_keeps_the_old_version(model, hub):
    parked = SafePoint(version=7)  # offered, but the engine never reaches a safe point
    engine = Engine(hub, "stuck", shard_specs(0, 1), apply=parked.offer, version=7)
    engine.receiver.timeouts = SyncTimeouts(bucket_timeout_s=2, apply_timeout_s=0.3)
    hub.wait_for_members(1, 10)
    publisher = WeightPublisher(model, hub=hub, config=PublishConfig(timeouts=FAST))
    with pytest.raises(WeightSyncError) as info:
        publisher.publish(8)
    assert info.value.phase == "apply" and info.value.peer == "stuck"
    assert engine.receiver.version == 7
    assert parked.run(engine.load) is None  # withdrawn: a late safe point does not apply it
    assert engine.applied == [] and parked.version == 7


def _fake_engine(hub, name):
    """A registered peer that then says nothing (hung process, wrong build)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.endpoint)
    hello = Hello(service=name, replica=9, pid=0)
    sock.send_multipart(codec.encode(hello, run_id="", sender=name, seq=1))
    return sock


def test_engine_missing_at_group_rendezvous_is_named(model, hub, monkeypatch):
    sock = _fake_engine(hub, "ghost")
    hub.wait_for_members(1, 10)
    monkeypatch.setattr(deadlines, "GROUP_TIMEOUT_S", 0.5)
    timeouts = SyncTimeouts(bucket_timeout_s=2, apply_timeout_s=2)
    publisher = WeightPublisher(model, hub=hub, config=PublishConfig(timeouts=timeouts))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        publisher.publish(1)
    assert info.value.phase == "group" and info.value.peer == "ghost"
    assert time.monotonic() - t0 < 3
    sock.close()


def test_engine_silent_on_metadata_is_named_dropped_and_rejoins(model, hub):
    good = Engine(hub, "good", shard_specs(0, 1))
    mute = Engine(hub, "mute", shard_specs(0, 1))
    hub.wait_for_members(2, 10)
    publisher = WeightPublisher(model, hub=hub, config=PublishConfig(timeouts=FAST))
    publisher.publish(1)
    handler = mute.receiver._sync
    mute.receiver._sync = lambda meta, attempt: None  # hung: joined the group, answers nothing
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        publisher.publish(2)
    assert info.value.phase == "meta" and info.value.peer == "mute"
    assert time.monotonic() - t0 < FAST_META_S + 1
    assert good.receiver.version == 1 and mute.receiver.version == 1  # aborted before bytes
    mute.receiver._sync = handler  # it recovers; being dropped made it register again
    wait_for(lambda: (hub.poll(), "mute" in hub.members)[1], 5, "mute re-registered")
    report = publisher.publish(2)
    assert report.engines == ["good", "mute"]
    assert good.receiver.version == 2 and mute.receiver.version == 2
