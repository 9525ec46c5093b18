"""How deep a learner step runs: from the service's loop to the policy loss, the frames a
traceback of an error in the loss shows (the trainer's thread's frames under the loop's)."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

from pipeline.config import load_config
from pipeline.runtime.service import ServiceContext
from pipeline.training.loss_terms import policy_loss_terms
from services.learner.service import LearnerService

from ..training._helpers import save_tiny_model
from .test_ranks import _groups

REPO = Path(__file__).resolve().parents[2]
MAX_FRAMES = 7


async def test_a_train_step_reaches_the_policy_loss_within_seven_frames(tmp_path, monkeypatch):
    model_dir = save_tiny_model(tmp_path / "model")
    config = load_config(
        str(REPO / "profiles/local-cpu.toml"),
        {"model.path": str(model_dir), "controller.prompts_per_step": "3"},
    )
    ctx = ServiceContext(
        config=config, role="learner", replica=0, run_id="r", run_dir=tmp_path / "run"
    )
    service = LearnerService(ctx)
    await service.setup()
    # one process: no follower ranks, so the step's groups are not encoded for them
    monkeypatch.setattr("services.learner.service.encode_groups", _no_followers)
    task = asyncio.current_task()
    assert task is not None
    seen: list[list[str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is policy_loss_terms.__code__ and not seen:
            thread_frames = []
            f = frame
            while f is not None:
                thread_frames.append(f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}")
                f = f.f_back
            loop_frames = []
            coro = task.get_coro()
            while getattr(coro, "cr_frame", None) is not None:  # the chain of awaits
                code = coro.cr_frame.f_code
                loop_frames.append(f"{Path(code.co_filename).name}:{code.co_name}")
                coro = coro.cr_await
            seen.append(loop_frames + thread_frames[::-1])

    threading.setprofile(profile)
    try:
        await service.thread.run(sys.setprofile, profile)  # the trainer's thread exists
        # the service loop's part of a step, as LearnerService.run does it
        pending = await service._submit(_groups(), 0, 0)
        metrics = await service._metrics(_groups(), pending)
    finally:
        threading.setprofile(None)
        await service.thread.run(sys.setprofile, None)
        await service.teardown()
    assert metrics["actor/updates"] > 0
    (stack,) = seen
    # from this coroutine (standing for LearnerService.run) down to the loss
    start = next(i for i, f in enumerate(stack) if f.endswith(":" + _this()))
    path = stack[start:]
    path = path[: next(i for i, f in enumerate(path) if f.endswith(":policy_loss_terms")) + 1]
    # the thread's bootstrap frames (threading.py, the pool's worker loop) are no part of it
    path = [f for f in path if not f.startswith(("threading.py", "thread.py:_worker"))]
    assert len(path) <= MAX_FRAMES, path


def _no_followers(groups: Any) -> Any:
    raise AssertionError("groups encoded for follower ranks that do not exist")


def _this() -> str:
    return "test_a_train_step_reaches_the_policy_loss_within_seven_frames"


def test_the_critic_and_reference_import_nothing_of_the_learners_service_code():
    import subprocess

    code = (
        "import sys, services.critic, services.reference, services.critic.worker;"
        "print([m for m in sys.modules if m in ('services.learner', 'services.learner.worker')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
