"""A controller SIGKILLed mid-run and started again resumes the run from its journal.

A real controller process (stand-in task) serves a fake rollout+learner made of the real
transport pieces. The controller is killed while the learner still holds prompts; a stale
drop and a StepDone are reported while it is dead (lost with it), then a new incarnation
starts. It takes the same run id, releases the unsettled prompts again under their uids
(the consumer takes each uid once), the learner's reports reach it when the learner
rejoins, and the run ends with every released uid trained once or dropped.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from pipeline.config import load_config
from pipeline.runtime import layout
from pipeline.transport import ControlClient, QueueClient, security
from pipeline.wire.messages import Hello, StepDone
from services.learner.step_reports import StepReports

REPO = Path(__file__).resolve().parents[2]
STEPS, PER_STEP, KILL_AT = 6, 4, 2


def _overrides(runs: Path) -> dict[str, str]:
    return {
        "run.name": "ctl",
        "run.runs_dir": str(runs),
        "task.warm_start_steps": "0",  # only this test's own stand-ins run
        "controller.steps": str(STEPS),
        "controller.prompts_per_step": str(PER_STEP),
        "controller.max_staleness": "1",
        "controller.max_inflight_prompts": "8",
        "controller.step_timeout_s": "60",
        "rollout.n_samples": "2",
        "queues.peer_timeout_s": "1.0",
    }


async def _fake_pipeline(procs, runs: Path, logs: Path) -> tuple[Counter[str], str]:
    overrides = _overrides(runs)
    config = load_config(str(REPO / "profiles/local-cpu.toml"), overrides)
    args = ["-m", "services.controller", "--profile", str(REPO / "profiles/local-cpu.toml")]
    for key, value in overrides.items():
        args += [f"--{key}", value]

    def start_controller(n: int):
        out = (logs / f"controller-{n}.log").open("wb")
        return procs.python(*args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    controller = start_controller(0)
    channel = config.queues.channel
    control = ControlClient(
        layout.controller_endpoint(config), service="learner", replica=0, config=channel
    )
    answer = await control.handshake(Hello(service="learner", replica=0, pid=os.getpid()), 60)
    prompts = await QueueClient(
        "prompts",
        [layout.queue_endpoint(config, "prompts", 0)],
        run_id=answer.run_id,
        consumer="rollout-0",
        config=channel,
    ).start()
    reports = StepReports(control)
    watch = asyncio.create_task(reports.watch())
    surfaced: Counter[str] = Counter()
    try:
        for step in range(STEPS):
            if step == KILL_AT:
                # killed once it has the last step and we hold this step's prompts
                while control.controller_version < step or prompts.buffered < PER_STEP + 1:
                    await asyncio.sleep(0.02)
                os.kill(controller.pid, signal.SIGKILL)
                assert await asyncio.to_thread(controller.wait, 10) == -signal.SIGKILL
            fresh, dropped = [], []
            while len(fresh) < PER_STEP:
                delivery = await prompts.get(timeout=60)
                surfaced[delivery.uid] += 1
                if step == KILL_AT and not dropped:
                    # too stale, say; reported to a dead controller, so lost with it
                    dropped = [f"{delivery.uid}/{i}" for i in range(2)]
                    await reports.dropped(dropped, step)
                    delivery.ack()
                    continue
                fresh.append(delivery)
            trained = [f"{d.uid}/{i}" for d in fresh for i in range(2)]
            control.policy_version = step + 1
            await reports.step_done(
                StepDone(
                    step=step, policy_version=step + 1, trained_uids=trained, dropped_uids=dropped
                )
            )
            for delivery in fresh:
                delivery.ack()
            if step == KILL_AT:
                controller = start_controller(1)
        await asyncio.wait_for(control.shutdown.wait(), 60)
        assert await asyncio.to_thread(controller.wait, 30) == 0
        return surfaced, answer.run_id
    finally:
        watch.cancel()
        await prompts.close()
        await control.close()


async def test_a_killed_controller_resumes_from_its_journal_and_nothing_is_lost(tmp_path, procs):
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    logs.mkdir()
    # the stand-ins are the run's own services: they hold its secret
    security.configure(None, run_secret=security.run_secret(runs / "ctl"))
    try:
        surfaced, run_id = await _fake_pipeline(procs, runs, logs)
    except BaseException:
        for log in sorted(logs.iterdir()):
            sys.stderr.write(f"--- {log.name}\n{log.read_text()[-3000:]}\n")
        raise
    finally:
        security.configure(None)
    run_dir = runs / "ctl"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS
    assert summary["incarnations"] == 2 and summary["run_id"] == run_id
    assert summary["dropped"] == 1 and summary["duplicates"] == 0
    assert summary["in_flight_at_end"] == 0 and summary["unknown_trained"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    assert summary["trained"] == STEPS * PER_STEP
    assert set(surfaced.values()) == {1}  # re-released prompts were not handed out twice
    assert len(surfaced) == summary["released"]
    steps = [
        json.loads(x)["step"] for x in (run_dir / "metrics/steps.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(STEPS))
    schedule = (run_dir / "schedule.jsonl").read_text().splitlines()
    assert len(schedule) == len({json.loads(x)["uid"] for x in schedule}) == STEPS * PER_STEP * 2
    resumed = [json.loads(x) for x in (logs / "controller-1.log").read_text().splitlines()]
    event = next(e for e in resumed if e.get("event") == "controller_resumed")
    assert event["step"] == KILL_AT and event["unsettled"] > 0
