"""(c) An engine SIGKILLed mid-sync: the learner names the phase and the engine within the
configured time, goes on with the other engine after rebuilding the weight group, and the
restarted engine rejoins and receives the current version.

The learner runs in this process (one rank, plain tensors); engines are real processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pipeline.errors import WeightSyncError
from pipeline.models import CausalLM
from pipeline.weights import PublishConfig, SyncTimeouts, WeightHub, WeightPublisher
from tests.weights.wsync_common import (
    ROLLOUT_DTYPE,
    SMALL_BUCKET_MB,
    TINY,
    assert_engine_equal,
    engine_cmd,
    free_port,
    read_events,
    wait_for,
)

BUCKET_S = 2.0


def _start(procs, endpoint, name, out, *extra, replica=0):
    events: list[dict] = []
    proc = procs.start(
        engine_cmd(endpoint, name, out, "--replica", str(replica), "--bucket-s", "5", *extra),
        stdout=-1,
    )
    threading.Thread(target=read_events, args=(proc, events), daemon=True).start()
    return proc, events


def test_killed_engine_is_named_dropped_and_rejoins(procs, tmp_path):
    torch.manual_seed(0)
    model = CausalLM(TINY)
    model.init_weights(std=0.2)
    hub = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    timeouts = SyncTimeouts(bucket_timeout_s=BUCKET_S, apply_timeout_s=10)
    config = PublishConfig(bucket_mb=SMALL_BUCKET_MB, timeouts=timeouts)
    publisher = WeightPublisher(model, hub=hub, config=config)
    assert publisher.plan.num_buckets > 6
    _, ev0 = _start(procs, hub.endpoint, "engine-0", tmp_path)
    victim, ev1 = _start(
        procs, hub.endpoint, "engine-1", tmp_path, "--slow-version", "2", replica=1
    )
    assert hub.wait_for_members(2, 30) == ["engine-0", "engine-1"]

    def expected() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(ROLLOUT_DTYPE) for n, p in model.named_parameters()}

    assert publisher.publish(1).engines == ["engine-0", "engine-1"]
    for member in ("engine-0", "engine-1"):
        assert_engine_equal(expected(), torch.load(tmp_path / f"{member}.v1.pt"), 0, 1)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    killed_at: list[float] = []

    def kill_when_receiving() -> None:
        wait_for(lambda: any(e.get("version") == 2 for e in ev1), 30, "engine-1 in bucket 0")
        os.kill(victim.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_when_receiving, daemon=True)
    killer.start()
    with pytest.raises(WeightSyncError) as info:
        publisher.publish(2)
    raised_at = time.monotonic()
    killer.join(5)
    assert info.value.phase == "buckets"
    assert info.value.peer == "engine-1"
    assert "engine-1" in str(info.value) and "buckets" in str(info.value)
    assert raised_at - killed_at[0] < BUCKET_S + 2.0  # the configured bucket deadline
    assert victim.wait(5) == -signal.SIGKILL

    # the run goes on with engine-0 after the group is rebuilt without engine-1
    report = publisher.publish(2)
    assert report.engines == ["engine-0"]
    assert report.generation == 2
    wait_for(lambda: (tmp_path / "engine-0.v2.pt").exists(), 10, "engine-0 v2")
    assert_engine_equal(expected(), torch.load(tmp_path / "engine-0.v2.pt"), 0, 1)
    assert not (tmp_path / "engine-1.v2.pt").exists()

    # the restarted engine registers, the group is rebuilt with it, it gets the current version
    _start(procs, hub.endpoint, "engine-1", tmp_path, replica=1)
    assert hub.wait_for_members(2, 30) == ["engine-0", "engine-1"]
    report = publisher.publish(2)
    assert report.engines == ["engine-0", "engine-1"]
    assert report.generation == 3
    assert_engine_equal(expected(), torch.load(tmp_path / "engine-1.v2.pt"), 0, 1)
    assert any(e.get("event") == "applied" and e.get("version") == 2 for e in ev0)
    publisher.close()
    hub.close()
