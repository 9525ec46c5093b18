"""(b) WeightMeta is checked against the engine's parameters before any byte moves."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pipeline.errors import MetadataRejected
from pipeline.weights.plan import BucketPlan, TensorSpec
from pipeline.weights.validate import ParamSpec, validate_meta
from pipeline.wire.messages import WeightMeta
from tests.weights.wsync_common import full_shapes, shard_specs

BF16 = torch.bfloat16


def _meta(bucket_bytes: int = 2048, **changes) -> WeightMeta:
    plan = BucketPlan.build(
        [TensorSpec(n, s, BF16) for n, s in full_shapes().items()], bucket_bytes=bucket_bytes
    )
    meta = WeightMeta(
        version=3, entries=plan.entries(), bucket_sizes=list(plan.bucket_sizes), transport="gloo"
    )
    return msgspec.structs.replace(meta, **changes)


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (0, 2), (1, 2)])
def test_matching_metadata_gives_the_unpack_layout(tp_rank, tp_size):
    layout = validate_meta(_meta(), shard_specs(tp_rank, tp_size), tp_size=tp_size)
    assert layout.version == 3 and layout.full["lm_head.weight"] == ((96, 31), BF16)
    assert sum(len(b) for b in layout.by_bucket) == len(_meta().entries)


def test_every_offender_is_listed_per_kind():
    specs = shard_specs(0, 1)
    del specs["model.norm.weight"]
    del specs["model.layers.1.mlp.up_proj.weight"]
    specs["model.extra.weight"] = ParamSpec((4,), BF16)
    specs["lm_head.weight"] = ParamSpec((95, 31), BF16)
    specs["model.layers.0.self_attn.q_proj.bias"] = ParamSpec((32,), torch.float32)
    with pytest.raises(MetadataRejected) as info:
        validate_meta(_meta(), specs)
    problems = info.value.problems
    assert sorted(problems["unknown"]) == ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    assert problems["missing"] == ["model.extra.weight"]
    assert [p.split(":")[0] for p in problems["shape"]] == ["lm_head.weight"]
    assert [p.split(":")[0] for p in problems["dtype"]] == ["model.layers.0.self_attn.q_proj.bias"]
    assert set(problems) == {"unknown", "missing", "shape", "dtype"}
    for name in ("model.norm.weight", "model.extra.weight", "lm_head.weight"):
        assert name in str(info.value)


def test_tp_engine_compares_against_the_full_shape():
    specs = shard_specs(0, 2)
    specs["model.layers.0.self_attn.o_proj.weight"] = ParamSpec((31, 32), BF16)  # unsliced
    with pytest.raises(MetadataRejected) as info:
        validate_meta(_meta(), specs, tp_size=2)
    assert info.value.problems["shape"] == [
        "model.layers.0.self_attn.o_proj.weight: [31, 32] != engine full [31, 64]"
    ]


def test_duplicates_and_broken_layouts_are_refused():
    meta = _meta(bucket_bytes=1 << 20)
    first, second = meta.entries[0], meta.entries[1]
    dup = _meta(bucket_bytes=1 << 20, entries=[first, second, first])
    with pytest.raises(MetadataRejected) as info:
        validate_meta(dup, shard_specs(0, 1))
    assert info.value.problems["duplicate"] == [first.name]
    moved = msgspec.structs.replace(second, offset=meta.bucket_sizes[0])  # past the bucket end
    broken = _meta(bucket_bytes=1 << 20, entries=[first, moved, *meta.entries[2:]])
    with pytest.raises(MetadataRejected) as info:
        validate_meta(broken, shard_specs(0, 1))
    assert any(second.name in p for p in info.value.problems["layout"])
    overlap = msgspec.structs.replace(second, offset=first.offset)
    bad = _meta(bucket_bytes=1 << 20, entries=[first, overlap, *meta.entries[2:]])
    with pytest.raises(MetadataRejected, match="overlap"):
        validate_meta(bad, shard_specs(0, 1))


def test_unknown_transport_and_dtype_names():
    meta = _meta(transport="carrier-pigeon")
    entries = [msgspec.structs.replace(meta.entries[0], dtype="float7"), *meta.entries[1:]]
    with pytest.raises(MetadataRejected) as info:
        validate_meta(msgspec.structs.replace(meta, entries=entries), shard_specs(0, 1))
    assert info.value.problems["transport"] == ["carrier-pigeon"]
    assert "float7" in info.value.problems["dtype"][0]


def test_a_receiver_reuses_the_layout_of_an_unchanged_meta_and_checks_any_change():
    from pipeline.weights import WeightReceiver
    from tests.weights.wsync_common import free_port

    receiver = WeightReceiver(
        "engine-0", f"tcp://127.0.0.1:{free_port()}", shard_specs(0, 1), lambda t, v: None
    )
    try:
        first = receiver._validate(_meta(version=3))
        again = receiver._validate(_meta(version=4))
        assert (first.version, again.version) == (3, 4)
        assert again.by_bucket is first.by_bucket  # not validated again
        assert again == validate_meta(_meta(version=4), shard_specs(0, 1))
        # any change is validated: another layout, a wrong shape
        other = receiver._validate(_meta(bucket_bytes=4096, version=5))
        assert other.bucket_sizes != first.bucket_sizes
        meta = _meta(version=6)
        entries = [msgspec.structs.replace(meta.entries[0], shape=(1, 2)), *meta.entries[1:]]
        with pytest.raises(MetadataRejected, match="shape"):
            receiver._validate(msgspec.structs.replace(meta, entries=entries))
    finally:
        receiver.close()


def _resharded(tp_rank: int, tp_size: int) -> WeightMeta:
    """What the publisher sends TP rank `tp_rank` of `tp_size`: its own shards."""
    from pipeline.weights.reshard import shard_plan

    full = BucketPlan.build(
        [TensorSpec(n, s, BF16) for n, s in full_shapes().items()], bucket_bytes=2048
    )
    plan = shard_plan(full, tp_rank, tp_size)
    return WeightMeta(
        version=3,
        entries=plan.entries(),
        bucket_sizes=list(plan.bucket_sizes),
        transport="gloo",
        tp_rank=tp_rank,
        tp_size=tp_size,
        p2p=True,
    )


def test_resharded_metadata_carries_the_engines_own_shards():
    layout = validate_meta(_resharded(1, 2), shard_specs(1, 2), tp_rank=1, tp_size=2)
    assert layout.resharded and layout.p2p
    assert layout.full["lm_head.weight"] == ((48, 31), BF16)  # the shard, not the full tensor
    assert layout.total_bytes < 0.6 * sum(_meta().bucket_sizes)


def test_resharded_metadata_for_another_rank_a_wrong_slice_or_a_missing_shard_is_refused():
    with pytest.raises(MetadataRejected) as info:  # rank 0's shards sent to rank 1
        validate_meta(_resharded(0, 2), shard_specs(1, 2), tp_rank=1, tp_size=2)
    assert info.value.problems["layout"] == ["shards of TP rank 0 of 2; this engine is rank 1 of 2"]
    with pytest.raises(MetadataRejected) as info:  # a 2-way split sent to a 4-way rank
        validate_meta(_resharded(1, 2), shard_specs(1, 4), tp_rank=1, tp_size=4)
    assert "rank 1 of 2; this engine is rank 1 of 4" in info.value.problems["layout"][0]
    assert "lm_head.weight: [48, 31] != engine shard [24, 31]" in info.value.problems["shape"]
    meta = _resharded(0, 2)
    gone = "model.layers.1.self_attn.k_proj.weight"
    meta = msgspec.structs.replace(meta, entries=[e for e in meta.entries if e.name != gone])
    with pytest.raises(MetadataRejected) as info:
        validate_meta(meta, shard_specs(0, 2), tp_rank=0, tp_size=2)
    assert info.value.problems["missing"] == [gone]
