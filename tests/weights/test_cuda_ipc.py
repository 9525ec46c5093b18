"""CUDA IPC: learner and engines share one GPU. Buffers are shared once and reused; per
bucket only a "ready" / "free" message moves. Bitwise like the collective path."""

from __future__ import annotations

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
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TIMEOUTS = SyncTimeouts(bucket_timeout_s=30, apply_timeout_s=30)


# (name, tp_size, replica) per engine process, and (tp_rank, tp_size) per engine rank
ENGINES = (("engine-0", 1, 0), ("engine-1", 2, 1))
RANKS = {"engine-0": (0, 1), "engine-1.tp0": (0, 2), "engine-1.tp1": (1, 2)}
# NCCL takes one rank per GPU: on two GPUs, the learner and one single-rank engine
ONE_ENGINE = (("engine-0", 1, 0),)
ONE_RANK = {"engine-0": (0, 1)}


def _engines(procs, hub, tmp_path, device, engines=ENGINES):
    events: list[dict] = []
    for name, tp_size, replica in engines:
        cmd = engine_cmd(hub.endpoint, name, tmp_path, "--device", device, tp_size=tp_size)
        proc = procs.start([*cmd, "--replica", str(replica), "--max-seconds", "300"], stdout=-1)
        threading.Thread(target=read_events, args=(proc, events), daemon=True).start()
    ranks = sum(tp_size for _, tp_size, _ in engines)
    assert len(hub.wait_for_members(ranks, 120)) == ranks
    return events


def _publish_and_check(model, publisher, tmp_path, versions, members=RANKS):
    for version in versions:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        report = publisher.publish(version)
        assert report.engines == list(members)
        expected = {n: p.detach().to(ROLLOUT_DTYPE).cpu() for n, p in model.named_parameters()}
        for member, (tp_rank, tp_size) in members.items():
            got = torch.load(tmp_path / f"{member}.v{version}.pt")
            assert_engine_equal(expected, got, tp_rank, tp_size)


def test_cuda_ipc_bitwise_with_buffers_opened_once(procs, tmp_path):
    torch.manual_seed(0)
    model = CausalLM(TINY).cuda()
    model.init_weights(std=0.2)
    hub = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    events = _engines(procs, hub, tmp_path, "cuda")
    config = PublishConfig(bucket_mb=SMALL_BUCKET_MB, transport="cuda_ipc", timeouts=TIMEOUTS)
    publisher = WeightPublisher(model, hub=hub, config=config)
    assert publisher.plan.num_buckets > 2  # both slots are reused many times per sync
    _publish_and_check(model, publisher, tmp_path, range(1, 4))
    applied = [e for e in events if e.get("event") == "applied"]
    assert len(applied) == 9
    assert {e["ipc_opened"] for e in applied} == {2}  # two slots, opened once per process
    publisher.close()
    hub.close()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_between_gpus_bitwise(procs, tmp_path):
    torch.manual_seed(0)
    model = CausalLM(TINY).cuda(0)
    model.init_weights(std=0.2)
    hub = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    _engines(procs, hub, tmp_path, "cuda:1", ONE_ENGINE)
    config = PublishConfig(bucket_mb=SMALL_BUCKET_MB, timeouts=TIMEOUTS)
    publisher = WeightPublisher(model, hub=hub, config=config)
    assert publisher.transport == "nccl"
    _publish_and_check(model, publisher, tmp_path, range(1, 3), ONE_RANK)
    publisher.close()
    hub.close()


def test_nccl_refuses_an_engine_on_the_learners_gpu_before_connecting(procs, tmp_path):
    model = CausalLM(TINY).cuda(0)
    hub = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    _engines(procs, hub, tmp_path, "cuda:0", ONE_ENGINE)
    config = PublishConfig(bucket_mb=SMALL_BUCKET_MB, transport="nccl", timeouts=TIMEOUTS)
    publisher = WeightPublisher(model, hub=hub, config=config)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        publisher.publish(1)
    assert time.monotonic() - t0 < 20  # not NCCL's connect, which waited without end
    assert info.value.phase == "group" and info.value.peer == "learner-0, engine-0"
    assert "one rank per GPU" in str(info.value)
    publisher.close()
    hub.close()
