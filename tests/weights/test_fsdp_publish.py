"""(a) A 2-rank FSDP2 learner publishes to 2 engine processes, bitwise.

engine-0 holds the full model; engine-1 is one process holding BOTH tensor-parallel shards
(tp=2) as two weight-group members ("engine-1.tp0", "engine-1.tp1"), each keeping its
slice. Three configurations run in the same processes, 3 versions each: one 1 GiB bucket;
2 KiB buckets (smaller than the largest tensor, so it spans buckets); and
2 KiB buckets sent by both learner ranks (striped, each its buckets' shards to the TP
ranks). After every version each engine
tensor must equal the learner's full tensor cast to bfloat16 (or its TP slice) bit for bit.
"""

from __future__ import annotations

import json

import torch

from tests.weights.wsync_common import HERE, assert_engine_equal, engine_cmd, free_port

VERSIONS = 3
CONFIGS = ["default", "small", "striped"]


def test_fsdp_learner_publishes_bitwise_to_plain_and_tp_engines(procs, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engines = [
        procs.start(engine_cmd(endpoint, "engine-0", tmp_path), stdout=-1),
        procs.start(
            engine_cmd(endpoint, "engine-1", tmp_path, "--replica", "1", tp_size=2), stdout=-1
        ),
    ]
    port = free_port()
    learners = [
        procs.python(
            str(HERE / "wsync_learner.py"),
            *("--rank", str(r), "--world", "2", "--port", str(port), "--endpoint", endpoint),
            *("--engines", "3", "--out", str(tmp_path), "--versions", str(VERSIONS)),
            stdout=-1,
        )
        for r in range(2)
    ]
    out, _ = learners[0].communicate(timeout=80)
    assert learners[0].returncode == 0
    out1, _ = learners[1].communicate(timeout=20)
    assert learners[1].returncode == 0
    published = [json.loads(line) for line in out.splitlines() if line.startswith(b"{")]
    on_rank1 = [json.loads(line) for line in out1.splitlines() if line.startswith(b"{")]
    # striped: learner rank 1 is a weight-group member too (2 learners + 3 engine ranks)
    for p0, p1 in zip(published, on_rank1, strict=True):
        assert p0["sources"] == ["fsdp"]  # one bucketed all_gather, no per-tensor fallback
        assert p0["group_world"] == (5 if p0["config"] == "striped" else 4)
        assert p1["group_world"] == (5 if p1["config"] == "striped" else 0)
        # the TP ranks get their shards alone, from every sender when striped
        assert p0["resharded"] and p1["resharded"] == (p1["config"] == "striped")
    assert [p["version"] for p in published] == list(range(1, VERSIONS * len(CONFIGS) + 1))
    by_config = {p["config"]: p["buckets"] for p in published}
    assert by_config["default"] == 1 and by_config["small"] > 3
    for p in published:
        assert p["engines"] == ["engine-0", "engine-1.tp0", "engine-1.tp1"]
    members = {"engine-0": (0, 1), "engine-1.tp0": (0, 2), "engine-1.tp1": (1, 2)}
    previous = None
    for version in range(1, VERSIONS * len(CONFIGS) + 1):
        expected = torch.load(tmp_path / f"learner.v{version}.pt")
        if previous is not None:  # the weights really changed between versions
            assert not torch.equal(expected["lm_head.weight"], previous["lm_head.weight"])
        previous = expected
        for member, (tp_rank, tp_size) in members.items():
            got = torch.load(tmp_path / f"{member}.v{version}.pt")
            assert_engine_equal(expected, got, tp_rank, tp_size)
    for engine in engines:
        assert engine.poll() is None  # still serving
