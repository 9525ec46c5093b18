"""NCCL connect with a member that arrived at the weight group and never connected (died
or stalled in between): the member that did connect fails within the group's deadline with
a WeightSyncError naming the others, instead of waiting in NCCL's init without end."""

from __future__ import annotations

import datetime
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from pipeline.weights.group import CONNECT_TIMEOUT_ENV, announce

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MEMBERS = ["learner-0", "engine-0"]
RENDEZVOUS_S = 8.0
# one member of a two-member NCCL group on cuda:0; prints how its build ended
MEMBER = """
import sys, time
import torch
from pipeline.errors import WeightSyncError
from pipeline.weights.group import WeightGroup, store_client
from pipeline.wire.weights import GroupAssign

port, rank, rendezvous_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
spec = GroupAssign(generation=1, rank=rank, world=2, senders=1, members=MEMBERS,
                   backend="nccl", store_host="127.0.0.1", store_port=port, timeout_s=30,
                   rendezvous_s=rendezvous_s)
store = store_client("127.0.0.1", port, rendezvous_s)
t0 = time.monotonic()
try:
    WeightGroup.build(store, spec, device=torch.device("cuda:0"))
except WeightSyncError as exc:
    print(f"RAISED {time.monotonic() - t0:.1f}|{exc.phase}|{exc.peer}|{exc}", flush=True)
    sys.exit(3)
print("BUILT", flush=True)
""".replace("MEMBERS", repr(MEMBERS))


@pytest.mark.parametrize("rank", [0, 1])  # the NCCL root (learner) connects, or an engine
def test_a_member_that_never_connects_fails_the_others_within_the_deadline(
    procs, monkeypatch, rank
):
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    # the other member arrived (on another GPU, so the one-rank-per-GPU check passes) and
    # then never called NCCL
    announce(dist.PrefixStore("weights/g1/", store), 1 - rank, "GPU-elsewhere")
    monkeypatch.delenv(CONNECT_TIMEOUT_ENV, raising=False)  # the default: rendezvous_s
    cmd = ["-c", MEMBER, str(store.port), str(rank), str(RENDEZVOUS_S)]
    proc = procs.python(*cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=RENDEZVOUS_S + 120)
    text = out.decode(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith(("RAISED", "BUILT"))]
    assert proc.returncode == 3 and lines, text[-3000:]
    seconds, phase, peer, message = lines[0].removeprefix("RAISED ").split("|", 3)
    assert (phase, peer) == ("group", MEMBERS[1 - rank])
    assert "did not complete" in message
    # the deadline, not NCCL's endless wait (CUDA start-up and the abort come on top)
    assert RENDEZVOUS_S - 1 <= float(seconds) <= RENDEZVOUS_S + 30, text[-3000:]
    assert time.monotonic() - t0 < RENDEZVOUS_S + 90
