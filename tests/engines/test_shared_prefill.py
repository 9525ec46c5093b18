"""Shared prefill: the samples of one request are prefilled by one row, and its keys and
values are copied to the siblings' slots. The samples must come out as if each had been
prefilled on its own: same tokens, log-probs equal up to batching round-off."""

from __future__ import annotations

import pytest

from pipeline.engines import GenerationRequest, SamplingParams, TorchEngine, TorchEngineConfig

from .helpers import assert_same_sample, make_model, prompts


def _generate(shared: bool, max_batch: int) -> tuple[list, list[int]]:
    """Outputs of three requests (n = 4, 1, 3) and the row count of every prefill forward."""
    model = make_model(seed=2)
    engine = TorchEngine(
        model, TorchEngineConfig(max_batch=max_batch, max_seq_len=64, shared_prefill=shared)
    )
    rows: list[int] = []
    forward = model.forward_cached

    def counting(ids, *args, **kwargs):
        if ids.shape[1] > 1:  # a prefill (decode steps feed one token a row)
            rows.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    model.forward_cached = counting
    batch = prompts(3, [5, 9, 3], seed=4)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=1),
        SamplingParams(temperature=0.0, max_new_tokens=7, n=1),
        SamplingParams(temperature=0.8, max_new_tokens=10, n=3, seed=2),
    ]
    pairs = enumerate(zip(batch, params, strict=True))
    requests = [GenerationRequest(f"r{i}", p, s) for i, (p, s) in pairs]
    outputs = sorted(engine.generate(requests), key=lambda o: (o.request_id, o.sample_index))
    return outputs, rows


@pytest.mark.parametrize("max_batch", [8, 3], ids=["all-at-once", "groups-split"])
def test_shared_prefill_generates_what_per_sample_prefill_does(max_batch: int):
    got, shared_rows = _generate(True, max_batch)
    want, own_rows = _generate(False, max_batch)
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert (g.request_id, g.sample_index) == (w.request_id, w.sample_index)
        assert_same_sample(g, w)
    assert sum(own_rows) == 8  # every sample prefilled on its own
    if max_batch == 8:  # one admission: one row per request
        assert shared_rows == [3]
    else:  # a request's samples admitted over several steps share within each admission
        assert sum(shared_rows) < sum(own_rows)


def test_the_engine_counts_prefill_rows_per_sample():
    """What the rollout reports as rollout/prefill_rows_per_sample: 2 prompt rows for the
    5 samples of two requests (n = 4 and 1), 5 without shared prefill."""
    for shared, rows in ((True, 2), (False, 5)):
        engine = TorchEngine(
            make_model(seed=2), TorchEngineConfig(max_batch=8, shared_prefill=shared)
        )
        params = [SamplingParams(max_new_tokens=3, n=4, seed=1), SamplingParams(max_new_tokens=3)]
        batch = prompts(2, [5, 9], seed=4)
        engine.generate(
            [
                GenerationRequest(f"r{i}", p, s)
                for i, (p, s) in enumerate(zip(batch, params, strict=True))
            ]
        )
        assert (engine.prefill_rows, engine.prefill_samples) == (rows, 5)
