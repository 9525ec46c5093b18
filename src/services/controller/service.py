"""Controller: dataset cursor, run clock, staleness budget, accounting, metrics sink.

It answers every service's hello with the resolved config, releases prompts only while
the staleness budget allows (a prompt for step s goes out once the learner has finished
step s - max_staleness - 1), and ends the run after the last step with a summary that
accounts for every released uid: trained once, or dropped for staleness.

Its state lives in a write-ahead journal in the run directory (`pipeline.runtime.journal`):
a controller killed and restarted by the supervisor finds the journal, takes the same run
id, releases again the prompts that were in flight (same uids, consumers de-duplicate),
and carries on; services say hello to the new incarnation on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.config import PipelineConfig, config_to_json, write_resolved
from pipeline.errors import ConfigError
from pipeline.log import bind_process, configure_logging, get_logger
from pipeline.runtime import layout
from pipeline.runtime.journal import (
    Accounting,
    Journal,
    ReleasedPrompt,
    RunState,
    load_state,
    prompt_uid,
    release_record,
    step_key,
)
from pipeline.runtime.json_lines import complete_lines
from pipeline.runtime.service import MetricsWriter
from pipeline.transport import ControlServer, QueueServer
from pipeline.transport.control import PeerEvent
from pipeline.transport.security import refused as refused_peers
from pipeline.wire.messages import (
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
from services.controller.step_log import StepLog

# seconds between looks at the release budget when no step moved it (acks free it too)
RELEASE_POLL_S = 0.02


class Controller:
    role = "controller"

    def __init__(self, config: PipelineConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.log = get_logger("controller")
        self.journal_path = run_dir / "controller" / "journal.jsonl"
        self.state = RunState()
        self.journal: Journal | None = None
        self._tokenizer: Any = None
        self._records: Any = None
        self.started = time.time()
        self.last_progress = self.started
        self.stepped = False  # a step finished since this controller started
        # steps in a row whose every reward failed / every optimizer step was skipped
        self.streaks = {"rewards_failing": 0, "updates_skipped": 0}
        self.failure = ""  # why the run ends before its last step
        # set when an entry is journaled (a step or a drop moves the staleness bound): the
        # release loop sends the next prompts at once instead of at its next poll
        self.budget_moved = asyncio.Event()

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def learner_version(self) -> int:
        return self.state.learner_version

    @property
    def accounting(self) -> Accounting:
        return self.state.accounting

    @property
    def released_count(self) -> int:
        return len(self.state.released)

    def record(self, entry: dict[str, Any]) -> None:
        """Journal first (fsynced), then apply: what is acted on survives a kill."""
        assert self.journal is not None, "prepare() opens the journal"
        self.journal.append(entry)
        self.state.apply(entry)
        self.budget_moved.set()  # a step or a drop moves the release budget

    # ------------------------------------------------------------------ set-up

    def _within_prompt_limit(self, task: Any) -> tuple[list[Any], int]:
        """The dataset's prompts no longer than task.max_prompt_tokens, and how many were
        dropped; a longer one refuses the dataset unless task.drop_long_prompts."""
        cfg = self.config.task
        if not task.records:
            raise ConfigError(f"task.dataset {cfg.dataset!r} has no rows; point it at a dataset")
        lengths = [len(task.tokenizer.encode(r.prompt_text)) for r in task.records]
        records = [
            r for r, n in zip(task.records, lengths, strict=True) if n <= cfg.max_prompt_tokens
        ]
        dropped = len(task.records) - len(records)
        if dropped and not cfg.drop_long_prompts:
            raise ConfigError(
                f"{dropped} of {len(task.records)} prompts are longer than "
                f"task.max_prompt_tokens = {cfg.max_prompt_tokens} tokens (the longest has "
                f"{max(lengths)}): raise task.max_prompt_tokens to {max(lengths)}, or set "
                "task.drop_long_prompts = true to train on the others"
            )
        if not records:
            raise ConfigError(
                f"every prompt is longer than task.max_prompt_tokens = {cfg.max_prompt_tokens}"
                f" (the shortest has {min(lengths)} tokens); raise it"
            )
        if dropped:
            self.log.warning("long_prompts_dropped", dropped=dropped, limit=cfg.max_prompt_tokens)
        return records, dropped

    def prepare(self) -> None:
        """Run directory, resolved config, data, tokenizer (and the tiny model if asked)."""
        from pipeline.data.cursor import PromptCursor
        from pipeline.tasks.prepare import prepare_task

        write_resolved(self.config, self.run_dir)
        import torch

        # the warm start runs here: a fixed thread count keeps it the same run to run
        torch.set_num_threads(max(1, self.config.run.torch_threads))
        task = prepare_task(self.config, self.run_dir)
        self._tokenizer = task.tokenizer
        records, dropped = self._within_prompt_limit(task)
        self._cursor = PromptCursor(records, seed=self.config.run.seed)
        self.open_state()
        (self.run_dir / "run.json").write_text(
            json.dumps(
                {
                    "run_id": self.run_id,
                    "started": self.started,
                    "pid": os.getpid(),
                    "incarnation": self.state.incarnations,
                    "prompts": len(records),
                    "dropped_long_prompts": dropped,
                }
            )
        )

    def open_state(self) -> None:
        """A new run's journal, or the state of the incarnation that was killed."""
        recovered = load_state(self.journal_path)
        if recovered is not None:
            self.state = recovered
            self.started = recovered.started
            self._cursor.take(len(recovered.released))  # the cursor is a seeded walk
        metrics = self.run_dir / "metrics"
        written = (
            complete_lines(metrics / "steps.jsonl"),
            complete_lines(self.run_dir / "schedule.jsonl"),
        )
        self.service_metrics = MetricsWriter(metrics / "services.jsonl")
        self.schedule = MetricsWriter(self.run_dir / "schedule.jsonl")
        self.journal = Journal(self.journal_path)
        self.record(
            {
                "kind": "start",
                "run_id": self.state.run_id or uuid.uuid4().hex[:12],
                "started": self.started,
                "pid": os.getpid(),
            }
        )
        self.steps_log = StepLog(
            self.run_dir,
            self.config.metrics,
            written=written[0],
            run_id=self.run_id,
            run_config=json.loads(config_to_json(self.config)),
        )
        # a step journaled just before the kill may be missing from the metrics files
        rows = [row for entry in self.state.steps for row in schedule_rows(entry)]
        for row in rows[written[1] :]:
            self.schedule.write(row)
        for entry in self.state.steps[written[0] :]:
            self.steps_log.write(entry["line"])
        if recovered is not None:
            self.log.warning(
                "controller_resumed",
                incarnation=self.state.incarnations,
                step=self.step,
                policy_version=self.learner_version,
                released=self.released_count,
                unsettled=len(self.state.unsettled()),
                metrics_restored=len(self.state.steps) - written[0],
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

    def next_release(self, index: int) -> ReleasedPrompt:
        """The prompt released as the run's `index`-th: its uid is unique by that index
        (the dataset cursor wraps around, so a record's own uid repeats)."""
        record = self._cursor.next()
        return ReleasedPrompt(
            uid=f"{index:06d}:{record.uid}",
            prompt_text=record.prompt_text,
            data_source=record.data_source,
            ground_truth=record.ground_truth,
            released_version=self.learner_version,
            max_new_tokens=record.max_new_tokens,
            ignore_eos=record.ignore_eos,
        )

    def encode(self, released: ReleasedPrompt) -> tuple[Prompt, Any]:
        import numpy as np

        from pipeline.wire.codec import TensorPack

        ids = self._tokenizer.encode(released.prompt_text)
        pack = TensorPack()
        ref = pack.add(np.asarray(ids, dtype=np.int32))
        r = self.config.rollout
        prompt = Prompt(
            uid=released.uid,
            prompt_ids=ref,
            n_samples=r.n_samples,
            data_source=released.data_source,
            ground_truth=released.ground_truth,
            prompt_text=released.prompt_text,
            released_version=released.released_version,
            # the row's own budget (checked against the run's limit at load), else the run's
            max_new_tokens=released.max_new_tokens or r.max_new_tokens,
            ignore_eos=released.ignore_eos,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
        )
        return prompt, pack

    async def release_loop(self, prompts: QueueServer) -> None:
        # what the killed incarnation released and nobody settled: it may have died with
        # its queue, or still be on its way; the same uid is taken once downstream
        again = self.state.unsettled()
        if again:
            self.log.info("prompts_released_again", count=len(again))
        for released in again:
            await prompts.send(*self.encode(released))
        cap = self.config.controller.max_inflight_prompts
        while True:
            # cleared before the budget is read: a step journaled from here on wakes the wait
            self.budget_moved.clear()
            budget = min(self.release_budget(), cap - prompts.unacked)
            if budget > 0:
                first = self.released_count
                batch = [self.next_release(first + i) for i in range(budget)]
                self.record(release_record(batch))
                for released in batch:
                    await prompts.send(*self.encode(released))
            # acks free budget too (no event for them): poll as well
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.budget_moved.wait(), RELEASE_POLL_S)

    # ------------------------------------------------------------------ inbox

    async def on_step_done(self, done: StepDone, control: ControlServer) -> None:
        key = step_key(done.step, done.policy_version, done.trained_uids)
        if key in self.state.step_keys:
            # the learner sends a step again until our heartbeats carry its version
            self.log.info("step_reported_again", step=done.step)
            return
        now = time.time()
        line = {
            "time": now,
            "step": done.step,
            "policy_version": done.policy_version,
            "trained": len(done.trained_uids),
            "dropped": len(done.dropped_uids),
            "elapsed_s": round(now - self.started, 3),
            **done.metrics,
            # messages the control socket refused so far, by reason
            **{f"controller/rejected.{k}": float(v) for k, v in control.stats.rejected.items()},
            # peers whose handshake failed (not part of the run), by reason
            **{f"controller/refused.{k}": float(v) for k, v in refused_peers().items()},
        }
        entry = {
            "kind": "step",
            "key": key,
            "step": done.step,
            "policy_version": done.policy_version,
            "trained_uids": done.trained_uids,
            "dropped_uids": done.dropped_uids,
            "line": line,
        }
        self.record(entry)
        for row in schedule_rows(entry):
            self.schedule.write(row)
        self.steps_log.write(line)
        self._note_failures(line)
        self.last_progress = now
        self.stepped = True
        self.log.info("step_done", step=done.step, trained=line["trained"], dropped=line["dropped"])
        # journaled: now the version may be announced (the learner's acknowledgement), and
        # heartbeats carry it to everyone (stand-in engines read it there)
        control.policy_version = self.learner_version
        await control.broadcast(
            Heartbeat(service="controller", policy_version=self.learner_version)
        )

    def _note_failures(self, line: dict[str, Any]) -> None:
        """Count the steps in a row whose every reward failed and those whose every
        optimizer step the learner skipped; at a limit, say why the run ends
        (`self.failure`)."""
        cfg = self.config.controller
        trained, errors = line["trained"], line.get("reward_errors", 0.0)
        updates, skipped = line.get("actor/updates", 0.0), line.get("actor/skipped_updates", 0.0)
        self._streak(
            "rewards_failing",
            bool(trained) and errors >= trained,
            cfg.failed_steps,
            "every reward failed in the last {n} steps (the verifier raised or timed out: "
            "read the reward services' logs); controller.failed_steps sets how many end the "
            "run",
        )
        self._streak(
            "updates_skipped",
            bool(updates) and skipped >= updates,
            cfg.failed_steps,
            "the learner skipped every optimizer step of the last {n} steps (a non-finite "
            "loss or gradient: the policy diverged or a kernel is wrong; actor/loss and "
            "actor/grad_norm in metrics/steps.jsonl show it); controller.failed_steps sets "
            "how many end the run",
        )

    def _streak(self, event: str, hit: bool, limit: int, why: str) -> None:
        """One more step of `event` in a row (or none: the count starts again); at `limit`
        (0: never) the run ends with `why` unless it already ends for another reason."""
        n = self.streaks[event] = self.streaks[event] + 1 if hit else 0
        if limit and n >= limit and not self.failure:
            self.failure = why.format(n=n)
            self.log.error(event, steps=n, error=self.failure)

    def stall_limit(self) -> float:
        """Seconds without a finished step before the run counts as stalled: the first
        step this controller sees (after a start or a restart of the run, services compile
        and capture their CUDA graphs on their first batch) gets
        `controller.first_step_timeout_s` where set, every other `step_timeout_s`."""
        cfg = self.config.controller
        if not self.stepped and cfg.first_step_timeout_s > 0:
            return cfg.first_step_timeout_s
        return cfg.step_timeout_s

    async def watchdog(self) -> None:
        """End the run with a clear error when no step finishes in `stall_limit()`."""
        while True:
            await asyncio.sleep(1.0)
            limit = self.stall_limit()
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
                if self.failure:
                    return
                if self.step >= self.config.controller.steps:
                    finished.set()
            elif isinstance(body, Dropped):
                groups = {prompt_uid(u) for u in body.uids}
                if groups - self.accounting.dropped:  # not a report sent again
                    self.record({"kind": "dropped", "uids": body.uids})
                    self.log.info("dropped_stale", groups=len(groups))
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
        )
        control.policy_version = self.learner_version
        control.start()
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
        if self.step >= self.config.controller.steps:
            finished.set()  # the killed incarnation had journaled the last step
        await asyncio.wait([*tasks, *waiters], return_when=asyncio.FIRST_COMPLETED)
        task: asyncio.Task[Any]
        for task in tasks:
            if task.done() and task.exception():
                raise task.exception()  # type: ignore[misc]
        summary = {
            "run_id": self.run_id,
            "steps": self.step,
            "completed": finished.is_set(),
            **({"failure": self.failure} if self.failure else {}),
            "seconds": round(time.time() - self.started, 3),
            "incarnations": self.state.incarnations,
            **self.accounting.summary(),
        }
        told_at = time.time()
        told = await control.broadcast(
            Shutdown(reason="run finished" if finished.is_set() else "stopped")
        )
        # the supervisor waits for these to save; any other service, or one started after
        # `told_at` under a told name (a restart), has nothing to save
        summary["told_to_stop"] = sorted(set(told))
        summary["told_at"] = told_at
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        await asyncio.sleep(0.2)
        for task in [*tasks, *waiters]:
            task.cancel()
        await prompts.close()
        await control.close()
        assert self.journal is not None
        self.journal.close()
        self.steps_log.close()
        self.log.info("run_finished", **summary)
        return summary


def schedule_rows(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """schedule.jsonl rows of a journaled step: which sample uid was trained when."""
    time_, step, version = entry["line"]["time"], entry["step"], entry["policy_version"]
    return [
        {"time": time_, "uid": uid, "step": step, "version": version}
        for uid in entry["trained_uids"]
    ]


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.cli_args import config_refused, service_args, supervised
    from pipeline.transport.channel import run_async

    try:
        args, config = service_args("controller", argv)
        if (code := supervised("controller", args, config, argv)) is not None:
            return code
        configure_logging()
        bind_process(service="controller")
        summary = run_async(Controller(config, layout.run_dir(config)).run())
    except ConfigError as exc:
        return config_refused(exc)
    return 0 if summary["completed"] or args.allow_incomplete else 1
