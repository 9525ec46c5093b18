"""Groups that reach the critic while it is busy share a forward (at most
critic.annotate_max_groups, never across a value update), their values match those of one
group a forward, and `pipeline replay` batches them as the run did (a real CriticService
on the tiny model, CPU)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.runtime.service import ServiceContext
from pipeline.wire.samples import read_group
from services.critic.service import CriticService
from services.critic.worker import CriticWorker

from ..training._helpers import save_tiny_model
from .test_critic_update_overlap import _decoded, _message
from .test_ranks import _critic_config, _groups

SIZES = (3, 2, 1, 2, 2)  # five groups: p0 .. p4


async def _serve(config, run_dir: Path, hold_first_update: bool) -> dict[str, object]:
    """The five groups through a CriticService: p0, then p1 (the step's end: its value
    update starts), then p2, p3, p4 together while that update is held."""
    ctx = ServiceContext(config=config, role="critic", replica=0, run_id="r", run_dir=run_dir)
    service = CriticService(ctx)
    await service.setup()
    trainer, release = service.worker.trainer, threading.Event()
    train_step, calls = trainer.train_step, []

    def held(batch):
        calls.append(len(calls))
        if hold_first_update and len(calls) == 1:
            assert release.wait(60), "never released"
        return train_step(batch)

    trainer.train_step = held
    messages = [_message(g) for g in _groups(seed=3, sizes=SIZES)]
    outputs = [*(await service.handle(messages[0])), *(await service.handle(messages[1]))]
    late = [asyncio.ensure_future(service.handle(m)) for m in messages[2:]]
    await asyncio.sleep(0.5)  # all three wait behind the held update
    release.set()
    for call in late:
        outputs += await asyncio.wait_for(call, 60)
    await service.teardown()
    return {
        "groups": {g.uid: g for g in (read_group(_decoded(o)) for o in outputs)},
        "messages": messages,
        "updates": service.worker.steps,
    }


def _values(group) -> list[np.ndarray]:
    return [s.extra["values"] for s in group.samples]


async def test_waiting_groups_share_a_forward_up_to_the_value_update(tmp_path: Path):
    model = str(save_tiny_model(tmp_path / "model"))
    config = _critic_config(model, **{"critic.annotate_max_groups": "3"})
    run = await _serve(config, tmp_path / "run", hold_first_update=True)
    lines = (tmp_path / "run/critic/batches.jsonl").read_text().splitlines()
    # three waited, but only two fit before the second value update (2 groups a step)
    assert [json.loads(line)["uids"] for line in lines] == [["p0"], ["p1"], ["p2", "p3"], ["p4"]]
    assert run["updates"] == 2
    # the values of one group a forward, through one worker
    single = CriticWorker(SimpleNamespace(config=config, run_dir=tmp_path / "one", ranks=None))
    single.build(-1)
    for group in (expected := _groups(seed=3, sizes=SIZES)):
        single.annotate([group])
    for want in expected:
        got = run["groups"][want.uid]
        for a, b in zip(_values(got), _values(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # the replay follows the run's batches: the same values, bit for bit
    replay_ctx = ServiceContext(
        config=config, role="critic", replica=0, run_id="r", run_dir=tmp_path / "replay"
    )
    replayer = CriticService(replay_ctx)
    await replayer.setup()
    outputs = await replayer.replay(run["messages"], tmp_path / "run")
    await replayer.teardown()
    replayed = {g.uid: g for g in (read_group(_decoded(o)) for o in outputs)}
    assert sorted(replayed) == sorted(run["groups"])
    for uid, group in replayed.items():
        for a, b in zip(_values(group), _values(run["groups"][uid]), strict=True):
            np.testing.assert_array_equal(a, b)


async def test_one_group_a_forward_records_no_batches(tmp_path: Path):
    model = str(save_tiny_model(tmp_path / "model"))
    run = await _serve(_critic_config(model), tmp_path / "run", hold_first_update=True)
    assert not (tmp_path / "run/critic/batches.jsonl").exists()
    assert run["updates"] == 2 and len(run["groups"]) == 5


def test_a_record_cut_short_is_read_up_to_its_last_whole_line(tmp_path: Path):
    """A critic killed while writing leaves half a line at the end: left out. A damaged line
    before the end is refused with its number."""
    from pipeline.errors import RecordingError
    from services.critic.service import _recorded_batches

    path = tmp_path / "batches.jsonl"
    path.write_text('{"uids": ["p0"]}\n{"uids": ["p1", "p2"]}\n{"uids": ["p')
    assert _recorded_batches(path) == [["p0"], ["p1", "p2"]]
    path.write_text('{"uids": ["p0"]}\n{"uid\n{"uids": ["p3"]}\n')
    with pytest.raises(RecordingError, match="line 2"):
        _recorded_batches(path)
    assert _recorded_batches(tmp_path / "absent.jsonl") == []


async def test_a_critic_restarted_after_a_kill_mid_write_appends_whole_lines(tmp_path: Path):
    """The critic before was killed while writing a batch line; the restarted one cuts that
    half line before it appends, so the record stays readable for a replay."""
    from services.critic.service import _recorded_batches

    model = str(save_tiny_model(tmp_path / "model"))
    config = _critic_config(model, **{"critic.annotate_max_groups": "3"})
    path = tmp_path / "run/critic/batches.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"uids": ["earlier"]}\n{"uids": ["p')
    await _serve(config, tmp_path / "run", hold_first_update=True)
    assert _recorded_batches(path) == [["earlier"], ["p0"], ["p1"], ["p2", "p3"], ["p4"]]
