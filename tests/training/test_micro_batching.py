"""Token-budget micro-batching: deterministic plans within budget, packed outputs that equal
per-sequence forwards, and gradients independent of how a batch is split."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import (
    ExperienceBatch,
    PolicyTrainer,
    TrainerConfig,
    pack_padded,
    pack_padding_free,
    plan_micro_batches,
    plan_step,
)
from pipeline.training.micro_batching import (
    _DEVICE_FIELDS,
    _one_buffer,
    micro_batch_weight,
    packed_copies,
)

from ._helpers import make_batch, make_model


def test_plan_respects_budget_is_deterministic_and_covers_every_sample_once():
    lengths = [7, 3, 9, 3, 12, 1, 5, 5]
    plan = plan_micro_batches(lengths, max_tokens=10)
    assert plan == plan_micro_batches(list(lengths), max_tokens=10)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert b == sorted(b)
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # 12 > budget: alone
    assert [12] in [[lengths[i] for i in b] for b in plan]


def test_min_count_splits_largest_micro_batches_then_appends_empty_ones():
    lengths = [4, 4, 4, 4]
    assert len(plan_micro_batches(lengths, 100)) == 1
    split = plan_micro_batches(lengths, 100, min_count=3)
    assert len(split) == 3 and sorted(i for b in split for i in b) == [0, 1, 2, 3]
    padded = plan_micro_batches([4], 100, min_count=3)
    assert padded == [[0], [], []]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_accumulation_weights_sum_to_world_size_per_global_mini_batch(mode: str):
    batch = make_batch(seed=3, n=10)
    plans = plan_step(batch, num_mini_batches=2, max_tokens=15, loss_agg_mode=mode)
    for plan in plans:
        assert sum(plan.weights) == pytest.approx(1.0)
    assert micro_batch_weight(3, 12, 2) == pytest.approx(0.5)
    assert micro_batch_weight(0, 0, 2) == 0.0


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_micro_batch_logprobs_equal_per_sequence_dense_logprobs(padding_free: bool):
    model = make_model()
    batch = make_batch(seed=1, n=5)
    pack = pack_padding_free if padding_free else pack_padded
    mb = pack(batch, [0, 2, 3])
    inputs = {
        "position_ids": mb.position_ids,
        "attention_mask": mb.attention_mask,
        "cu_seqlens": mb.cu_seqlens,
    }
    logp = mb.gather(model.token_logprobs(mb.input_ids, mb.target_ids, **inputs))  # (3, r)
    # the output layer on the response-predicting positions only
    scored = model.token_logprobs(mb.input_ids, mb.target_ids, score_index=mb.score_index, **inputs)
    mask = mb.fields(batch.response_mask)
    assert scored.shape == (int(mask.sum()),)  # one entry per response token
    torch.testing.assert_close(
        mb.gather_scored(scored)[mask.bool()], logp[mask.bool()], atol=1e-5, rtol=1e-5
    )
    for row, i in enumerate([0, 2, 3]):
        seq = torch.cat([batch.prompt_ids[i], batch.response_ids[i]])[None]
        dense = model.token_logprobs(seq[:, :-1], seq[:, 1:])[0]  # (len - 1,)
        p, n = batch.prompt_ids[i].numel(), batch.response_ids[i].numel()
        torch.testing.assert_close(logp[row, :n], dense[p - 1 :], atol=1e-5, rtol=1e-5)
        assert mask[row, :n].all() and not mask[row, n:].any()


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_fields_to_equals_field_by_field_restriction(padding_free: bool):
    batch = make_batch(seed=4, n=6)
    pack = pack_padding_free if padding_free else pack_padded
    mb = pack(batch, [4, 1, 3])  # not in batch order
    named = {
        "mask": batch.response_mask,
        "behaviour": batch.behaviour_logprobs,
        "absent": None,
        "adv": torch.randn(batch.response_mask.shape, dtype=torch.float64),
    }
    got = mb.fields_to(torch.device("cpu"), named)
    assert sorted(got) == ["adv", "behaviour", "mask"]
    for key in got:
        want = mb.fields(named[key])  # type: ignore[arg-type]
        assert got[key].dtype == want.dtype and got[key].shape == want.shape == (3, mb.width)
        assert torch.equal(got[key], want)


def test_packed_copies_are_aligned_views_of_one_buffer_per_dtype():
    g = torch.Generator().manual_seed(0)
    named = {
        "ids": torch.randint(0, 9, (1, 7), generator=g),
        "mask": torch.rand(3, 5, generator=g) > 0.5,
        "cu": torch.tensor([0, 3, 7]),
        "logp": torch.randn(3, 5, generator=g),
        "empty": torch.zeros(0, dtype=torch.long),
    }
    buffers: list[torch.Tensor] = []
    got = packed_copies(named, lambda b: buffers.append(b.clone()) or buffers[-1])
    assert len(buffers) == 3  # int64, bool, float32
    for key, t in named.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
        assert got[key].data_ptr() % 16 == 0, key
        assert any(got[key].untyped_storage().data_ptr() == b.data_ptr() for b in buffers)
    # the trunk's inputs sit where the shapes alone put them: two micro-batches of the same
    # bucketed shapes with other response lengths give them the same offsets
    copied = [
        packed_copies(
            {k: getattr(pack_padding_free(make_batch(seed=s, n=3), [0, 1, 2], bucket=64), k)
             for k in _DEVICE_FIELDS if k != "attention_mask"},
            torch.Tensor.clone,
        )
        for s in (5, 6)
    ]  # fmt: skip
    assert copied[0]["score_index"].shape != copied[1]["score_index"].shape
    for key in ("input_ids", "position_ids", "cu_seqlens"):
        assert copied[0][key].shape == copied[1][key].shape
        assert copied[0][key].storage_offset() == copied[1][key].storage_offset(), key
    # a micro-batch moved to its own device keeps every tensor as it is
    mb = pack_padding_free(make_batch(seed=2, n=3), [0, 2], bucket=8)
    moved = mb.to(torch.device("cpu"))
    assert moved.input_ids is mb.input_ids and moved.cu_seqlens is mb.cu_seqlens
    assert moved.sample_indices is mb.sample_indices


def _first_update_grads(
    model_dir: Path,
    config: TrainerConfig,
    algorithm: AlgorithmConfig,
    batch: ExperienceBatch | None = None,
) -> dict[str, torch.Tensor]:
    """Gradients of the first optimizer step, captured just before it is applied."""
    batch = batch if batch is not None else make_batch(seed=11, n=10)
    trainer = PolicyTrainer(model_dir, config, algorithm)
    grads: dict[str, torch.Tensor] = {}
    apply = trainer.engine.apply_gradients

    def capture(*args, **kwargs):
        if not grads:
            grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return apply(*args, **kwargs)

    trainer.engine.apply_gradients = capture  # type: ignore[method-assign]
    trainer.train_step(batch)
    return grads


def test_bucketed_packing_pads_to_few_shapes_and_scores_the_same_positions():
    batch = make_batch(seed=3, n=6)
    indices = [0, 2, 3, 5]
    plain = pack_padding_free(batch, indices)
    padded = pack_padding_free(batch, indices, bucket=16)
    total = plain.num_tokens
    width = padded.input_ids.shape[1]
    assert width % 16 == 0 and total <= width < total + 16
    assert padded.num_tokens == total  # metrics count real tokens only
    cu = padded.cu_seqlens.tolist()
    assert len(cu) - 1 == 8  # 4 sequences + the padding one, rounded up to a power of two
    assert cu[: len(indices) + 1] == plain.cu_seqlens.tolist()
    assert cu[-1] == width and cu == sorted(cu)  # trailing empty sequences
    assert padded.max_seqlen == 128  # a power of two, at least 128, bounding every length
    assert padded.max_seqlen >= plain.max_seqlen
    assert torch.equal(padded.gather_index, plain.gather_index)
    assert torch.equal(padded.score_index, plain.score_index)  # the padding is never scored
    assert torch.equal(padded.input_ids[0, :total], plain.input_ids[0])
    assert torch.equal(padded.position_ids[0, total:], torch.arange(width - total))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradients_do_not_depend_on_micro_batch_budget_or_packing(tmp_path: Path, mode: str):
    from pipeline.models import save_model

    save_model(make_model(), tmp_path / "model")
    algorithm = AlgorithmConfig(loss_agg_mode=mode, use_kl_loss=True, entropy_coef=0.01)
    # a budget above the whole batch: one micro-batch, the full-batch loss
    reference = _first_update_grads(
        tmp_path / "model",
        TrainerConfig(device="cpu", max_tokens_per_micro_batch=10_000),
        algorithm,
    )
    # the last: packed micro-batches padded to buckets of 16 tokens (CUDA-graph shapes)
    for budget, padding_free, bucket in [
        (40, True, 0),
        (9, True, 0),
        (25, False, 0),
        (40, True, 16),
    ]:
        config = TrainerConfig(
            device="cpu",
            max_tokens_per_micro_batch=budget,
            padding_free=padding_free,
            pack_bucket_tokens=bucket,
        )
        grads = _first_update_grads(tmp_path / "model", config, algorithm)
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, reference[name], atol=1e-6, rtol=1e-5, msg=f"{budget} {name}"
            )


def test_equal_lengths_pack_as_uniform_rows_only_when_no_padding_is_needed():
    batch = make_batch(seed=4, n=4, prompt_len=(3, 4), response_len=(5, 6))  # 8 tokens each
    for bucket in (0, 16):
        packed = pack_padding_free(batch, [0, 1, 2, 3], bucket=bucket)
        assert packed.uniform and packed.max_seqlen == 8
        assert packed.input_ids.shape == (1, 32)
        assert packed.cu_seqlens.tolist() == [0, 8, 16, 24, 32]
    # three sequences of 8 in buckets of 16: padded as before, so not uniform
    padded = pack_padding_free(batch, [0, 1, 2], bucket=16)
    assert not padded.uniform and padded.input_ids.shape == (1, 32)
    mixed = pack_padding_free(make_batch(seed=3, n=6), [0, 2, 3, 5])
    assert not mixed.uniform


def test_uniform_rows_attention_trains_like_varlen_packing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Equal-length sequences attended as a (rows, length) batch (SDPA on CPU) give the
    same first-update gradients as the packed block-diagonal path."""
    from pipeline.models import attention, save_model

    calls = []
    rows_causal = attention.rows_causal

    def spy(q, k, v, rows, *, cudnn):
        calls.append(rows)
        return rows_causal(q, k, v, rows, cudnn=cudnn)

    monkeypatch.setattr(attention, "rows_causal", spy)

    save_model(make_model(), tmp_path / "model")
    algorithm = AlgorithmConfig(entropy_coef=0.01)
    batch = make_batch(seed=12, n=6, prompt_len=(4, 5), response_len=(6, 7))
    grads = {}
    for uniform in (True, False):
        config = TrainerConfig(
            device="cpu", max_tokens_per_micro_batch=40, uniform_attention=uniform
        )
        calls.clear()
        grads[uniform] = _first_update_grads(tmp_path / "model", config, algorithm, batch)
        # 6 sequences of 10 tokens in 40-token micro-batches: rows of 4 and of 2, per layer
        assert sorted(set(calls)) == ([2, 4] if uniform else [])
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[True].items():
        torch.testing.assert_close(grad, grads[False][name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_packer_lays_the_device_fields_out_in_one_buffer_that_moves_them_all():
    """pack_padding_free puts every input and layout field in one int64 buffer, in
    _DEVICE_FIELDS order at 16-byte boundaries; a copy of the buffer carries them all, and a
    field replaced since packing sends the micro-batch back to one copy per dtype."""
    mb = pack_padding_free(make_batch(seed=3, n=4), [0, 2, 3], bucket=64)
    assert mb.buffer is not None and mb.buffer.dtype == torch.long
    fields = [k for k in _DEVICE_FIELDS if getattr(mb, k) is not None]
    offsets = [getattr(mb, k).storage_offset() for k in fields]
    assert offsets == sorted(offsets) and all(o % 2 == 0 for o in offsets)
    storage = mb.buffer.untyped_storage().data_ptr()
    assert all(getattr(mb, k).untyped_storage().data_ptr() == storage for k in fields)
    copy = mb.on_copy(mb.buffer.clone())
    assert copy.buffer is not None and copy.buffer.data_ptr() != mb.buffer.data_ptr()
    for k in fields:
        got, want = getattr(copy, k), getattr(mb, k)
        assert torch.equal(got, want) and got.shape == want.shape, k
        assert got.untyped_storage().data_ptr() == copy.buffer.untyped_storage().data_ptr(), k
    meta = torch.device("meta")
    moved = mb.to(meta)
    assert moved.buffer is not None and moved.buffer.device == meta
    assert all(getattr(moved, k).device == meta for k in fields)
    replaced = dataclasses.replace(mb, input_ids=mb.input_ids.clone()).to(meta)
    assert replaced.buffer is None and replaced.input_ids.device == meta
    with pytest.raises(ValueError, match="attention_masks"):  # not a device field
        _one_buffer({"input_ids": np.zeros((1, 4), np.int64), "attention_masks": np.zeros(2)})
    # the trunk's inputs sit where the bucketed shapes alone put them in the buffer (a
    # compiled trunk sees one input layout per shape), whatever the response lengths
    a, b = (pack_padding_free(make_batch(seed=s, n=3), [0, 1, 2], bucket=64) for s in (5, 6))
    assert a.score_index.shape != b.score_index.shape
    for key in ("input_ids", "position_ids", "cu_seqlens"):
        assert getattr(a, key).shape == getattr(b, key).shape, key
        assert getattr(a, key).storage_offset() == getattr(b, key).storage_offset(), key


def test_host_fields_are_indexed_without_torch_cpu_index_ops():
    """fields/put on host tensors go through NumPy (torch's CPU index op uses the intra-op
    thread pool even for a few KB, which stalled a busy GPU host for milliseconds): the
    same values as torch's indexing, for each field dtype and a strided field, and no
    aten::index / aten::index_put_ on the way."""
    from torch.profiler import ProfilerActivity, profile

    batch = make_batch(seed=5, n=6)
    mb = pack_padding_free(batch, [4, 1, 3])
    rows = torch.tensor([4, 1, 3])
    named = {
        "mask": batch.response_mask,
        "adv": batch.advantages,
        "ids": (batch.advantages * 100).long(),
        "strided": batch.advantages.t().contiguous().t(),
        "double": batch.advantages.double(),
    }
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = {k: mb.fields(v) for k, v in named.items()}
        out = torch.zeros_like(batch.advantages)
        mb.put(out, got["adv"])
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::index", "aten::index_put_", "aten::_index_put_impl_"}, ops
    for key, value in named.items():
        assert torch.equal(got[key], value[rows, : mb.width]), key
    assert torch.equal(out[rows, : mb.width], batch.advantages[rows, : mb.width])
    assert not out[[0, 2, 5]].any()  # rows outside the micro-batch untouched
