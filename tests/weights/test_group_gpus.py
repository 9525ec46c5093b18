"""The NCCL weight group refuses two ranks on one GPU before connecting, on every member."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from pipeline.errors import WeightSyncError
from pipeline.weights.group import announce, check_one_rank_per_gpu, shared_gpus
from pipeline.wire.weights import GroupAssign

MEMBERS = ["learner-0", "engine-0", "engine-1.tp0", "engine-1.tp1"]


def _spec(rank: int) -> GroupAssign:
    return GroupAssign(
        generation=3,
        rank=rank,
        world=len(MEMBERS),
        senders=1,
        members=MEMBERS,
        backend="nccl",
        store_host="127.0.0.1",
        store_port=0,
        timeout_s=5,
        rendezvous_s=5,
    )


def test_shared_gpus_names_the_members_of_each_gpu_held_twice():
    keys = {0: "GPU-a", 1: "GPU-b", 2: "GPU-b", 3: "GPU-b"}
    assert shared_gpus(keys, MEMBERS) == [["engine-0", "engine-1.tp0", "engine-1.tp1"]]
    keys = {3: "GPU-a", 0: "GPU-a", 1: "GPU-b", 2: "GPU-c"}  # rank order, not arrival order
    assert shared_gpus(keys, MEMBERS) == [["learner-0", "engine-1.tp1"]]
    assert shared_gpus({0: "GPU-a", 1: "GPU-b", 2: "GPU-c", 3: "GPU-d"}, MEMBERS) == []
    assert shared_gpus({0: "", 1: "", 2: "GPU-a", 3: ""}, MEMBERS) == []  # no GPU: no claim


def _store() -> tuple[dist.TCPStore, dist.PrefixStore]:
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )
    return store, dist.PrefixStore("weights/g3/", store)


@pytest.mark.parametrize(
    ("gpus", "peer"),
    [
        (["GPU-a", "GPU-b", "GPU-b", "GPU-b"], "engine-0, engine-1.tp0, engine-1.tp1"),
        (["GPU-a", "GPU-b", "GPU-c", "GPU-a"], "learner-0, engine-1.tp1"),
    ],
)
def test_every_member_refuses_a_shared_gpu_with_the_same_error(gpus, peer):
    store, prefix = _store()
    for rank, gpu in enumerate(gpus):
        announce(prefix, rank, gpu)
    errors: dict[int, WeightSyncError] = {}

    def member(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        with pytest.raises(WeightSyncError) as info:
            check_one_rank_per_gpu(dist.PrefixStore("weights/g3/", client), _spec(rank))
        errors[rank] = info.value

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(MEMBERS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(errors) == [0, 1, 2, 3]
    assert {(e.phase, e.peer) for e in errors.values()} == {("group", peer)}
    assert len({str(e) for e in errors.values()}) == 1
    assert "one rank per GPU" in str(errors[0]) and "cuda_ipc" in str(errors[0])


def test_distinct_gpus_and_members_without_a_gpu_pass():
    _, prefix = _store()
    for rank, gpu in enumerate(["GPU-a", "GPU-b", "GPU-c", "GPU-d"]):
        announce(prefix, rank, gpu)
    check_one_rank_per_gpu(prefix, _spec(0))
    _, prefix = _store()
    for rank in range(len(MEMBERS)):  # as gloo members announce: no GPU
        announce(prefix, rank, "")
    check_one_rank_per_gpu(prefix, _spec(2))
