"""Bucket plan and tensor-parallel slicing (pure functions)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.weights import tp
from pipeline.weights.plan import BucketPlan, TensorSpec, chunks_of
from tests.weights.wsync_common import full_shapes

BF16 = torch.bfloat16


def _specs() -> list[TensorSpec]:
    return [TensorSpec(n, s, BF16) for n, s in full_shapes().items()]


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 4096, 2048, 300, 64])
def test_plan_covers_every_byte_in_order_within_bucket_limits(bucket_bytes):
    specs = _specs()
    plan = BucketPlan.build(specs, bucket_bytes=bucket_bytes, align=256)
    assert [c.name for c in plan.chunks if c.start == 0] == [s.name for s in specs]
    assert all(0 < size <= bucket_bytes for size in plan.bucket_sizes)
    for spec in specs:
        chunks = [c for c in plan.chunks if c.name == spec.name]
        assert sum(c.nbytes for c in chunks) == spec.nbytes
        assert [c.start for c in chunks] == [
            sum(x.nbytes for x in chunks[:i]) for i in range(len(chunks))
        ]
        assert [c.bucket for c in chunks] == list(
            range(chunks[0].bucket, chunks[0].bucket + len(chunks))
        )
        assert all(c.offset % 256 == 0 and c.nbytes % 2 == 0 for c in chunks)
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    for k, chunks in enumerate(plan.by_bucket):  # no overlap, sizes are the used bytes
        spans = sorted((c.offset, c.offset + c.nbytes) for c in chunks)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert plan.bucket_sizes[k] == spans[-1][1]
    assert chunks_of(plan.entries()) == list(plan.chunks)  # the wire form loses nothing


def test_one_bucket_by_default_and_split_only_when_larger_than_a_bucket():
    plan = BucketPlan.build(_specs())
    assert plan.num_buckets == 1
    small = BucketPlan.build(_specs(), bucket_bytes=2048)
    split = {c.name for c in small.chunks if not (c.start == 0 and c.last)}
    assert split == {s.name for s in _specs() if s.nbytes > 2048}
    assert "lm_head.weight" in split and "model.norm.weight" not in split


def test_duplicate_names_refused():
    spec = TensorSpec("a", (2,), BF16)
    with pytest.raises(ConfigError, match="duplicate"):
        BucketPlan.build([spec, spec])


def test_entries_carry_dtype_and_shape():
    specs = [TensorSpec("a", (3, 5), BF16), TensorSpec("b", (7,), torch.float32)]
    plan = BucketPlan.build(specs, bucket_bytes=1024)
    entries = plan.entries()
    assert [(e.name, e.dtype, e.shape) for e in entries] == [
        ("a", "bfloat16", (3, 5)),
        ("b", "float32", (7,)),
    ]
    assert entries[1].offset == 256 and entries[1].nbytes == 28


@pytest.mark.parametrize(
    "name,dim",
    [
        ("model.layers.3.self_attn.q_proj.weight", 0),
        ("model.layers.3.self_attn.k_proj.bias", 0),
        ("model.layers.3.mlp.gate_proj.weight", 0),
        ("model.layers.3.mlp.up_proj.weight", 0),
        ("model.layers.3.self_attn.o_proj.weight", 1),
        ("model.layers.3.mlp.down_proj.weight", 1),
        ("model.layers.3.self_attn.o_proj.bias", None),
        ("model.embed_tokens.weight", 0),
        ("lm_head.weight", 0),
        ("model.layers.3.input_layernorm.weight", None),
        ("model.layers.3.self_attn.q_norm.weight", None),
        ("model.norm.weight", None),
    ],
)
def test_tp_split_rules(name, dim):
    assert tp.split_dim(name) == dim


def test_tp_shards_reassemble_the_full_tensor():
    full = torch.arange(8 * 6).reshape(8, 6)
    for name, dim in (("x.q_proj.weight", 0), ("x.o_proj.weight", 1)):
        parts = [tp.shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(torch.cat(parts, dim), full)
        assert tp.full_shape(name, tuple(parts[0].shape), 2) == (8, 6)
    assert tp.shard("model.norm.weight", full, 1, 2) is full


def test_tp_refuses_unknown_names_and_uneven_splits():
    with pytest.raises(ConfigError, match="no tensor-parallel rule"):
        tp.split_dim("model.layers.0.mystery.weight")
    with pytest.raises(ConfigError, match="does not split"):
        tp.shard("lm_head.weight", torch.zeros(97, 4), 0, 2)
