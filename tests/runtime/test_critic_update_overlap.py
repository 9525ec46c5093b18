"""The critic sends a step's last group on before its value update, and annotates the next
group after that update (a real CriticService on the tiny model, CPU)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from pipeline.runtime.service import ServiceContext
from pipeline.wire import codec
from pipeline.wire.messages import Scored
from pipeline.wire.samples import read_group, write_group
from services.critic.service import CriticService
from services.critic.worker import CriticWorker

from ..training._helpers import save_tiny_model
from .test_ranks import _critic_config, _groups


def _message(group) -> codec.Message:
    body, pack = write_group(group, Scored)
    return codec.decode(codec.encode(body, run_id="r", sender="reward-0", seq=0, tensors=pack))


def _decoded(output) -> codec.Message:
    body, pack = output
    return codec.decode(codec.encode(body, run_id="r", sender="critic-0", seq=0, tensors=pack))


async def test_the_steps_last_group_goes_on_while_the_value_update_runs(tmp_path: Path):
    config = _critic_config(str(save_tiny_model(tmp_path / "model")))
    ctx = ServiceContext(config=config, role="critic", replica=0, run_id="r", run_dir=tmp_path)
    service = CriticService(ctx)
    await service.setup()
    trainer = service.worker.trainer
    release = threading.Event()
    started = threading.Event()
    train_step = trainer.train_step

    def held_train_step(batch):
        started.set()
        assert release.wait(60), "the test never released the value update"
        return train_step(batch)

    trainer.train_step = held_train_step
    first, last, late = (_message(g) for g in _groups(seed=3))
    await service.handle(first)
    # prompts_per_step = 2: the second group completes the step and starts the update,
    # which is held; the group must come back all the same
    (out,) = await asyncio.wait_for(service.handle(last), timeout=30)
    assert await asyncio.to_thread(started.wait, 30)
    assert service.worker.steps == 0
    sent = read_group(_decoded(out))
    assert all("advantages" in s.extra for s in sent.samples)
    # the next group waits for the update: its values come from the updated critic
    late_call = asyncio.ensure_future(service.handle(late))
    await asyncio.sleep(0.5)
    assert not late_call.done()
    release.set()
    (late_out,) = await asyncio.wait_for(late_call, timeout=60)
    assert service.worker.steps == 1
    await service.teardown()
    spans = [
        json.loads(line)
        for line in (tmp_path / "metrics/critic-0.jsonl").read_text().splitlines()
        if '"critic_update"' in line
    ]
    assert len(spans) == 1 and spans[0]["end"] > spans[0]["start"]
    # the same groups through one worker, the update inside the last group's call
    single = CriticWorker(SimpleNamespace(config=config, run_dir=tmp_path / "one", ranks=None))
    single.build(-1)
    expected = _groups(seed=3)
    for group in expected:
        single.annotate([group])
    got = read_group(_decoded(late_out))
    assert single.steps == 1
    for want, have in zip(expected[2].samples, got.samples, strict=True):
        np.testing.assert_allclose(have.extra["values"], want.extra["values"], rtol=1e-6)
