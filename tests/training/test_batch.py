"""ExperienceBatch: built from ragged numpy arrays, padded per token, sliced and sharded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.training import BatchError, ExperienceBatch, group_ids_from_uids

from ._helpers import make_batch


def test_from_lists_pads_per_token_fields_and_unpad_round_trips():
    batch = ExperienceBatch.from_lists(
        [np.array([1, 2], dtype=np.int32), np.array([3])],
        [np.array([4, 5, 6], dtype=np.int32), np.array([7])],
        [np.array([-0.1, -0.2, -0.3], dtype=np.float32), np.array([-0.4], dtype=np.float32)],
        [1.0, 0.0],
        uids=["a/0", "a/1"],
        values=[np.array([0.5, 0.6, 0.7]), np.array([0.8])],
    )
    assert batch.response_mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.behaviour_logprobs.dtype == torch.float32
    assert batch.group_ids[0] == batch.group_ids[1]
    assert batch.seq_lengths == [5, 2]
    assert int(batch.response_mask.sum()) == 4  # response tokens
    np.testing.assert_allclose(batch.unpad("values")[1], [0.8])
    assert batch.advantages is None
    with pytest.raises(BatchError, match="not set"):
        batch.unpad("advantages")


def test_group_ids_are_stable_hashes_of_the_prompt_uid_equal_across_shards():
    ids = group_ids_from_uids(["q/0", "p/0", "q/1", "p/1", "r"])
    assert ids[0] == ids[2] and ids[1] == ids[3]
    assert len({ids[0], ids[1], ids[4]}) == 3
    assert all(0 <= i < 2**63 for i in ids)
    assert group_ids_from_uids(["p/7"]) == [ids[1]]  # no per-process salt, no running index


def test_shard_is_strided_and_the_shards_hold_all_samples():
    batch = make_batch(seed=0, n=7)
    shards = [batch.shard(r, 2) for r in range(2)]
    assert [s.uids for s in shards] == [batch.uids[0::2], batch.uids[1::2]]
    assert sorted(u for s in shards for u in s.uids) == sorted(batch.uids)
    shard, i = shards[1], shards[1].uids.index(batch.uids[3])
    n = int(batch.response_lengths[3])
    assert torch.equal(shard.advantages[i, :n], batch.advantages[3, :n])


def test_malformed_batches_are_refused_with_the_reason():
    with pytest.raises(BatchError, match="response of 2 tokens"):
        ExperienceBatch.from_lists([[1]], [[2, 3]], [[-0.1]], [0.0])
    with pytest.raises(BatchError, match="empty prompts"):
        ExperienceBatch.from_lists([[]], [[2]], [[-0.1]], [0.0])
    with pytest.raises(BatchError, match="unknown per-token"):
        ExperienceBatch.from_lists([[1]], [[2]], [[-0.1]], [0.0], bogus=[[1.0]])
