"""Controller: dataset cursor, run clock, staleness budget, accounting, metrics sink.

It answers every service's hello with the resolved config, releases prompts only while
the staleness budget allows (a prompt for step s goes out once the learner has finished
step s - max_staleness - 1), and ends the run after the last step with a summary that
accounts for every released uid: trained once, or dropped for staleness.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.config import PipelineConfig, config_to_json, write_resolved
from pipeline.errors import ConfigError
from pipeline.log import bind_process, configure_logging, get_logger
from pipeline.messages import (
    ConfigMsg,
    Dropped,
    ErrorMsg,
    Heartbeat,
    Hello,
    Metrics,
    Prompt,
    Shutdown,
    StepDone,
)
from pipeline.runtime import layout
from pipeline.runtime.service import MetricsWriter
from pipeline.transport import ControlServer, QueueServer
from pipeline.transport.control import PeerEvent


class Accounting:
    """Every released prompt uid ends trained exactly once or dropped; nothing else."""

    def __init__(self) -> None:
        self.released: set[str] = set()
        self.trained: dict[str, int] = {}
        self.dropped: set[str] = set()
        self.duplicates: list[str] = []

    def on_step(self, done: StepDone) -> None:
        for uid in done.trained_uids:
            prompt_uid = uid.rsplit("/", 1)[0]
            if prompt_uid in self.trained and self.trained[prompt_uid] != done.step:
                self.duplicates.append(prompt_uid)
            self.trained[prompt_uid] = done.step
        for uid in done.dropped_uids:
            self.dropped.add(uid.rsplit("/", 1)[0])

    def summary(self) -> dict[str, Any]:
        settled = set(self.trained) | self.dropped
        return {
            "released": len(self.released),
            "trained": len(self.trained),
            "dropped": len(self.dropped - set(self.trained)),
            "duplicates": len(self.duplicates),
            "in_flight_at_end": len(self.released - settled),
            "unknown_trained": len(set(self.trained) - self.released),
        }


class Controller:
    role = "controller"

    def __init__(self, config: PipelineConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.run_id = uuid.uuid4().hex[:12]
        self.log = get_logger("controller")
        self.learner_version = 0
        self.step = 0
        self.released_count = 0
        self.accounting = Accounting()
        self.steps_log = MetricsWriter(run_dir / "metrics" / "steps.jsonl")
        self.service_metrics = MetricsWriter(run_dir / "metrics" / "services.jsonl")
        self.schedule = MetricsWriter(run_dir / "schedule.jsonl")
        self._tokenizer: Any = None
        self._records: Any = None
        self.started = time.time()
        self.last_progress = self.started

    # ------------------------------------------------------------------ set-up

    def prepare(self) -> None:
        """Run directory, resolved config, data, tokenizer (and the tiny model if asked)."""
        from pipeline.data.cursor import PromptCursor
        from pipeline.tasks import prepare_task

        write_resolved(self.config, self.run_dir)
        import torch

        # the warm start runs here: a fixed thread count keeps it the same run to run
        torch.set_num_threads(max(1, self.config.run.torch_threads))
        task = prepare_task(self.config, self.run_dir)
        self._tokenizer = task.tokenizer
        limit = self.config.task.max_prompt_tokens
        records = [r for r in task.records if len(task.tokenizer.encode(r.prompt_text)) <= limit]
        if len(records) < len(task.records):
            self.log.warning(
                "overlong_prompts_skipped",
                skipped=len(task.records) - len(records),
                limit=limit,
                hint="raise task.max_prompt_tokens to keep them",
            )
        if not records:
            raise ConfigError(
                f"every prompt is longer than task.max_prompt_tokens = {limit}; raise it"
            )
        self._cursor = PromptCursor(records, seed=self.config.run.seed)
        (self.run_dir / "run.json").write_text(
            json.dumps({"run_id": self.run_id, "started": self.started, "pid": os.getpid()})
        )

    def config_for(self, hello: Hello) -> ConfigMsg:
        return ConfigMsg(
            run_id=self.run_id,
            run_dir=str(self.run_dir),
            config_json=config_to_json(self.config),
            policy_version=self.learner_version,
        )

    # ------------------------------------------------------------------ release

    def release_budget(self) -> int:
        """Prompts that may be released now under the staleness bound."""
        c = self.config.controller
        per_step = c.prompts_per_step
        allowed_steps = min(self.learner_version + c.max_staleness + 1, c.steps)
        target = allowed_steps * per_step + len(self.accounting.dropped)
        return max(0, target - self.released_count)

    def make_prompt(self) -> tuple[Prompt, Any]:
        import numpy as np

        from pipeline.codec import TensorPack

        record = self._cursor.next()
        ids = self._tokenizer.encode(record.prompt_text)
        pack = TensorPack()
        ref = pack.add(np.asarray(ids, dtype=np.int32))
        r = self.config.rollout
        uid = f"{self.released_count:06d}:{record.uid}"
        prompt = Prompt(
            uid=uid,
            prompt_ids=ref,
            n_samples=r.n_samples,
            data_source=record.data_source,
            ground_truth=record.ground_truth,
            prompt_text=record.prompt_text,
            released_version=self.learner_version,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
        )
        return prompt, pack

    async def release_loop(self, prompts: QueueServer) -> None:
        cap = self.config.controller.max_inflight_prompts
        while True:
            budget = min(self.release_budget(), cap - prompts.unacked)
            for _ in range(max(0, budget)):
                prompt, pack = self.make_prompt()
                self.accounting.released.add(prompt.uid)
                self.released_count += 1
                await prompts.send(prompt, pack)
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ inbox

    async def on_step_done(self, done: StepDone, control: ControlServer) -> None:
        self.accounting.on_step(done)
        self.learner_version = done.policy_version
        control.policy_version = done.policy_version
        self.step = done.step + 1
        self.last_progress = time.time()
        for uid in done.trained_uids:
            self.schedule.write({"uid": uid, "step": done.step, "version": done.policy_version})
        record = {
            "step": done.step,
            "policy_version": done.policy_version,
            "trained": len(done.trained_uids),
            "dropped": len(done.dropped_uids),
            "elapsed_s": round(time.time() - self.started, 3),
            **done.metrics,
        }
        self.steps_log.write(record)
        self.log.info("step_done", **{k: record[k] for k in ("step", "trained", "dropped")})
        # heartbeats carry the version to everyone (stand-in engines read it there)
        await control.broadcast(Heartbeat(service="controller", policy_version=done.policy_version))

    async def watchdog(self) -> None:
        """End the run with a clear error when no step finishes in `step_timeout_s`."""
        limit = self.config.controller.step_timeout_s
        while True:
            await asyncio.sleep(1.0)
            if time.time() - self.last_progress > limit:
                self.log.error(
                    "run_stalled",
                    step=self.step,
                    seconds=limit,
                    hint="no learner step finished in time; read runs/<name>/logs/*.log",
                )
                return

    async def inbox_loop(self, control: ControlServer, finished: asyncio.Event) -> None:
        while True:
            item = await control.inbox.get()
            if isinstance(item, PeerEvent):
                if item.kind == "dead":
                    self.log.warning("service_lost", peer=item.peer.name)
                continue
            peer, body = item
            if isinstance(body, StepDone):
                await self.on_step_done(body, control)
                if self.step >= self.config.controller.steps:
                    finished.set()
            elif isinstance(body, Dropped):
                for uid in body.uids:
                    self.accounting.dropped.add(uid.rsplit("/", 1)[0])
                self.log.info("dropped_stale", groups=len({u.rsplit("/", 1)[0] for u in body.uids}))
            elif isinstance(body, Metrics):
                self.service_metrics.write(
                    {
                        "service": body.service,
                        "replica": body.replica,
                        "step": body.step,
                        **body.values,
                    }
                )
            elif isinstance(body, ErrorMsg):
                self.log.error(
                    "service_error", peer=peer.name, kind=body.kind, message=body.message
                )

    # ------------------------------------------------------------------ main

    async def run(self) -> dict[str, Any]:
        self.prepare()
        channel = self.config.queues.channel
        control = ControlServer(
            layout.controller_endpoint(self.config),
            run_id=self.run_id,
            config_for=self.config_for,
            config=channel,
        ).start()
        prompts = QueueServer(
            "prompts",
            layout.bind_endpoint(self.config, "prompts", 0),
            run_id=self.run_id,
            sender="controller-0",
            config=channel,
        ).start()
        self.log.info("controller_ready", control=control.endpoint, run_dir=str(self.run_dir))
        finished = asyncio.Event()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [
            asyncio.create_task(self.release_loop(prompts)),
            asyncio.create_task(self.inbox_loop(control, finished)),
        ]
        waiters = [
            asyncio.create_task(finished.wait()),
            asyncio.create_task(stop.wait()),
            asyncio.create_task(self.watchdog()),
        ]
        await asyncio.wait([*tasks, *waiters], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done() and task.exception():
                raise task.exception()  # type: ignore[misc]
        summary = {
            "run_id": self.run_id,
            "steps": self.step,
            "completed": finished.is_set(),
            "seconds": round(time.time() - self.started, 3),
            **self.accounting.summary(),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        await control.broadcast(Shutdown(reason="run finished" if finished.is_set() else "stopped"))
        await asyncio.sleep(0.2)
        for task in [*tasks, *waiters]:
            task.cancel()
        await prompts.close()
        await control.close()
        self.log.info("run_finished", **summary)
        return summary


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import service_args

    args, config = service_args("controller", argv)
    configure_logging()
    bind_process(service="controller")
    from pipeline.transport.channel import run_async

    summary = run_async(Controller(config, layout.run_dir(config)).run())
    return 0 if summary["completed"] or args.allow_incomplete else 1


if __name__ == "__main__":
    raise SystemExit(main())
