"""Continuous batching: samples join and leave independently, with results equal to solo runs."""

from __future__ import annotations

from pipeline.engines import GenerationOutput, GenerationRequest, SamplingParams

from .helpers import assert_same_sample, prompts


def _solo(make_torch_engine, request: GenerationRequest) -> GenerationOutput:
    (out,) = make_torch_engine(max_batch=1).generate([request])
    return out


def _drive(engine, steps: int) -> dict[str, tuple[int, GenerationOutput]]:
    done: dict[str, tuple[int, GenerationOutput]] = {}
    for step in range(steps):
        for out in engine.step():
            done[out.request_id] = (step, out)
    return done


def test_samples_finish_independently_and_late_requests_join_while_others_run(
    make_torch_engine,
):
    engine = make_torch_engine(max_batch=3)
    batch = prompts(6, [4, 9, 2, 7, 5, 12], seed=2)
    max_new = [3, 10, 6, 2, 8, 4]
    requests = [
        GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=m))
        for i, (p, m) in enumerate(zip(batch, max_new, strict=True))
    ]
    for request in requests[:4]:
        engine.add_request(request)

    done: dict[str, tuple[int, GenerationOutput]] = {}
    for step in range(2):
        for out in engine.step():
            done[out.request_id] = (step, out)
        assert (len(engine._running), len(engine._waiting)) == (3, 1)  # r3 waits for a slot
    assert done == {}
    # submitted while r0..r2 run; r0 finishes at the end of step 2 and frees a slot
    engine.add_request(requests[4])
    engine.add_request(requests[5])
    assert len(engine._waiting) == 3
    step = 2
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = (step, out)
        step += 1
        assert step < 40

    finish_step = {rid: s for rid, (s, _) in done.items()}
    if not engine.overlap:
        # a sample admitted at step a with m new tokens finishes at step a + m - 1
        assert finish_step == {
            "r0": 2,  # admitted at 0, 3 tokens
            "r2": 5,  # admitted at 0, 6 tokens, r1 (10 tokens) still running
            "r3": 4,  # took r0's slot at step 3 (FIFO), 2 tokens
            "r1": 9,
            "r4": 12,  # r3's slot frees at 4: admitted at 5, 8 tokens
            "r5": 9,  # r2's slot frees at 5: admitted at 6, 4 tokens
        }
    else:
        # the device still finishes at a + m - 1; the host learns it one step later (the
        # slot is admitted one step after that) and returns the output two steps later
        assert finish_step == {
            "r0": 4,  # admitted at 0, 3 tokens: finished at 2, slot free from 4
            "r2": 7,  # finished at 5, slot free from 7
            "r3": 7,  # took r0's slot at step 4, finished at 5
            "r1": 11,
            "r4": 16,  # r3's slot (finished at 5) free from 7: admitted at 7, 8 tokens
            "r5": 12,  # r2's slot free from 7: admitted at 7, 4 tokens
        }
    for request in requests:
        got = done[request.request_id][1]
        assert len(got.output_ids) == request.params.max_new_tokens
        assert_same_sample(got, _solo(make_torch_engine, request))


def test_stop_token_ends_one_sample_while_the_others_continue(make_torch_engine):
    batch = prompts(3, [5, 8, 3], seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    solo = [_solo(make_torch_engine, GenerationRequest("s", p, params)) for p in batch]
    stop = solo[1].output_ids[2]
    first = solo[1].output_ids.index(stop)  # the stop token may already occur earlier
    stopping = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop, 95))

    engine = make_torch_engine(max_batch=4)
    outs = engine.generate(
        [
            GenerationRequest("a", batch[0], params),
            GenerationRequest("b", batch[1], stopping),
            GenerationRequest("c", batch[2], params),
        ]
    )
    assert outs[1].output_ids == solo[1].output_ids[: first + 1]
    assert outs[1].finish_reason == "stop"
    assert outs[1].token_versions == [0] * (first + 1)
    assert_same_sample(outs[0], solo[0])
    assert_same_sample(outs[2], solo[2])


def test_prefill_budget_splits_admission_without_changing_results(make_torch_engine):
    batch = prompts(5, [9, 3, 12, 6, 7], seed=8)
    requests = [
        GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=5))
        for i, p in enumerate(batch)
    ]
    engine = make_torch_engine(max_batch=5, max_prefill_tokens=16)
    engine.add_request(requests[0])
    engine.add_request(requests[1])
    engine.add_request(requests[2])
    engine.step()  # 2 x 9 padded tokens would exceed 16: only r0 is admitted
    assert len(engine._running) == 1
    engine.step()  # r1 (3) fits; r1 + r2 would be 2 x 12 = 24 > 16
    assert len(engine._running) == 2
    for request in requests[3:]:
        engine.add_request(request)
    done = _drive(engine, 20)
    assert not engine.has_unfinished()
    for request in requests[1:]:
        assert_same_sample(done[request.request_id][1], _solo(make_torch_engine, request))
