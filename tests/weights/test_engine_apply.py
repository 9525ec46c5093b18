"""The engine side of a sync with the built-in engine driven by the rollout service's
EngineRunner, over gloo in one process: the receiver's WeightDone (so the learner's publish)
comes only once the engine serves the new weights, the receiver's staging is the engine's
only staging copy, and an update withdrawn at the apply deadline is never applied later."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pipeline.engines import TorchEngine, TorchEngineConfig
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
from services.rollout.runner import EngineRunner
from tests.engines.helpers import tensor_bytes_held
from tests.weights.wsync_common import TINY, free_port, wait_for

FAST = SyncTimeouts(bucket_timeout_s=5, apply_timeout_s=10)


@pytest.fixture(autouse=True)
def fast_deadlines(monkeypatch):
    """The group's and the metadata's deadlines (module constants), short here."""
    monkeypatch.setattr(deadlines, "GROUP_TIMEOUT_S", 5.0)
    monkeypatch.setattr(deadlines, "META_TIMEOUT_S", 2.0)


class GatedEngine(TorchEngine):
    """The built-in engine whose step waits for `gate` first: a long step, which holds the
    engine's next safe point back."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__(model, TorchEngineConfig(max_batch=2, max_seq_len=32))
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0

    def step(self):
        self.gate.wait()
        outputs = super().step()
        self.steps += 1
        return outputs


class Sync:
    """Learner (publisher, hub) and one engine (runner, receiver) in this process."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.learner = CausalLM(TINY)
        self.learner.init_weights(std=0.2)
        served = CausalLM(TINY).eval()
        served.init_weights(std=0.2)  # other weights than the learner's
        self.engine = GatedEngine(served)
        self.loop = asyncio.new_event_loop()
        self.runner = EngineRunner(self.engine, tokenizer=None, loop=self.loop)
        self.hub = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
        # what weight_link.start_receiver builds
        self.receiver = WeightReceiver(
            "rollout-0",
            self.hub.endpoint,
            self.engine.model,
            self.runner.update_weights,
            timeouts=FAST,
            version=self.runner.version,
        )
        self.receiver.start()
        self.hub.wait_for_members(1, 10)
        config = PublishConfig(dtype=torch.float32, bucket_mb=4096 / MIB, timeouts=FAST)
        self.publisher = WeightPublisher(self.learner, hub=self.hub, config=config)

    def live(self) -> list[torch.Tensor]:
        return list(self.engine.model.parameters())

    def serves_learner(self) -> bool:
        got = dict(self.engine.model.named_parameters())
        return all(torch.equal(got[n], p) for n, p in self.learner.named_parameters())

    def bump(self) -> None:
        with torch.no_grad():
            for p in self.learner.parameters():
                p.add_(0.01)

    def close(self) -> None:
        self.engine.gate.set()
        self.receiver.stop()
        self.loop.run_until_complete(self.runner.close())
        self.loop.close()
        self.publisher.close()
        self.hub.close()


@pytest.fixture
def sync():
    s = Sync()
    yield s
    s.close()


def test_publish_returns_only_once_the_engine_serves_the_update(sync):
    assert not sync.serves_learner() and sync.engine.version == 0
    seen: dict[str, object] = {}

    def publish() -> None:
        seen["report"] = sync.publisher.publish(1)
        # what the engine serves the moment the learner hears WeightDone
        seen["version"], seen["runner"] = sync.engine.version, sync.runner.version
        seen["live"] = sync.serves_learner()

    sync.engine.gate.clear()  # the engine loop is held in a long step (it was idle before)
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    wait_for(sync.engine.weights.has_pending, 10, "every bucket landed and offered")
    publisher.join(0.5)
    assert publisher.is_alive(), "WeightDone came before the engine applied the update"
    assert sync.engine.version == 0 and sync.receiver.version == 0
    assert not sync.serves_learner()
    # offered, not copied: besides its live weights the engine holds only the staging tensors
    staging = list(sync.receiver.staging.tensors.values())
    assert tensor_bytes_held(sync.engine.weights, besides=[*sync.live(), *staging]) == 0

    sync.engine.gate.set()  # the safe point comes
    publisher.join(10)
    assert not publisher.is_alive()
    assert seen["report"].engines == ["rollout-0"]
    assert seen["version"] == seen["runner"] == 1 and seen["live"] is True
    assert sync.receiver.version == 1
    assert tensor_bytes_held(sync.engine.weights, besides=sync.live()) == 0

    sync.bump()
    sync.publisher.publish(2)  # an idle engine loop applies it too, then acknowledges
    assert sync.engine.version == 2 and sync.serves_learner()


def test_update_that_misses_the_apply_deadline_is_never_applied_later(sync):
    sync.publisher.publish(1)
    v1 = {n: p.detach().clone() for n, p in sync.engine.model.named_parameters()}
    sync.receiver.timeouts = SyncTimeouts(bucket_timeout_s=5, apply_timeout_s=0.3)
    sync.bump()
    sync.engine.gate.clear()
    with pytest.raises(WeightSyncError) as info:
        sync.publisher.publish(2)
    assert info.value.phase == "apply" and info.value.peer == "rollout-0"
    assert "old version kept" in str(info.value)
    steps = sync.engine.steps
    sync.engine.gate.set()  # the safe point comes after the receiver gave up
    wait_for(lambda: sync.engine.steps > steps, 10, "the engine's next step")
    assert sync.engine.version == 1 and sync.receiver.version == 1
    for name, param in sync.engine.model.named_parameters():
        assert torch.equal(param, v1[name]), name

    sync.receiver.timeouts = FAST
    sync.bump()
    sync.publisher.publish(3)  # the next update lands over the withdrawn one's staging
    assert sync.engine.version == 3 and sync.serves_learner()
