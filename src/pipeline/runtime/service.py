"""The service base: lifecycle, handshake, queues, signals, metrics.

A service subclass says what it does with one input message (`handle`) or overrides
`run` for its own loop; `serve` does the rest: hello -> config -> ready with the
controller, binds its output queue, connects its input queue (recording it if asked),
and stops cleanly on SIGTERM/SIGINT or the controller's shutdown. A sharded trainer
(torchrun, `runtime/ranks.py`) serves on rank 0; its other ranks `follow` rank 0's
commands instead.

Delivery is acknowledged along the chain: an input is acknowledged only after every
output made from it has been acknowledged downstream, so a service that dies loses
nothing: its producer redelivers what it had not acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pipeline.config import PipelineConfig, config_from_json, config_to_json
from pipeline.log import bind_process, configure_logging, get_logger
from pipeline.runtime import layout
from pipeline.runtime.ranks import RankLink
from pipeline.transport import ControlClient, Delivery, QueueClient, QueueServer
from pipeline.transport.channel import cancel_and_wait
from pipeline.wire import codec
from pipeline.wire.messages import Hello, Metrics, RankCommand, RankOp
from pipeline.wire.recording import QueueRecorder, queue_path

Output = tuple[Any, codec.TensorPack | None]


@dataclass
class ServiceContext:
    config: PipelineConfig
    role: str
    replica: int
    run_id: str
    run_dir: Path
    control: ControlClient | None = None
    output: QueueServer | None = None
    input: QueueClient | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    policy_version: int = 0
    # the command channel to the other ranks of a sharded service (on every rank); None
    # in a single process
    ranks: RankLink | None = None
    # the model parts built during the handshake (pipeline.runtime.early_build), for setup to take
    early: Any = None


class MetricsWriter:
    """JSON lines under runs/<name>/metrics/, one file per service replica."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the service

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"time": time.time(), **record}) + "\n")

    def close(self) -> None:
        self._file.close()


class Service:
    role: ClassVar[str] = ""
    # items processed concurrently by the default loop
    concurrency: int = 4
    # builds the role's model parts from the local config while the service waits for the
    # controller (pipeline.runtime.early_build); None: nothing to build early
    early_parts: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        # set when a handler stops counting against `concurrency` before it ends (occupied)
        self.room = asyncio.Event()
        self.log = get_logger(self.role)
        self._ack_waiters: set[asyncio.Future[Any]] = set()
        self.metrics = MetricsWriter(ctx.run_dir / "metrics" / f"{self.role}-{ctx.replica}.jsonl")

    @classmethod
    def follower(cls, ctx: ServiceContext) -> Any:
        """What a rank other than 0 of a sharded service runs: an object whose
        `execute(command)` does its part of each of rank 0's commands (`follow`). None: the
        role does not shard."""
        return None

    async def setup(self) -> None:
        """Load models and data; runs before the first input is taken."""

    async def handle(self, message: codec.Message) -> list[Output]:
        raise NotImplementedError(f"{type(self).__name__} must implement handle() or run()")

    async def teardown(self) -> None:
        """Release what setup took."""

    async def replay(self, messages: list[codec.Message], run_dir: Path) -> list[Output]:
        """Handle recorded inputs in recorded order (`pipeline replay`)."""
        outputs: list[Output] = []
        for message in messages:
            outputs.extend(await self.handle(message))
        return outputs

    def span(self, name: str, start: float, end: float, **fields: Any) -> None:
        """A timeline interval (wall-clock seconds) for the run's Perfetto trace."""
        self.metrics.write(
            {
                "kind": "span",
                "name": name,
                "start": start,
                "end": end,
                "replica": self.ctx.replica,
                **fields,
            }
        )

    async def report(self, step: int, values: dict[str, float]) -> None:
        self.metrics.write({"step": step, **values})
        if self.ctx.control is not None:
            await self.ctx.control.send(
                Metrics(service=self.role, replica=self.ctx.replica, step=step, values=values)
            )

    async def process(self, delivery: Delivery) -> None:
        """Handle one input and hand its outputs on; the input is acked once they are."""
        start = time.time()
        outputs = await self.handle(delivery.message)
        self.span(self.role, start, time.time(), uid=delivery.uid)
        acks = []
        for body, tensors in outputs:
            assert self.ctx.output is not None, f"{self.role} has no output queue"
            acks.append(await self.ctx.output.send(body, tensors))
        if not acks:
            delivery.ack()
            return
        # waiting for downstream acks must not hold a processing slot: the sink may
        # acknowledge only after it has gathered a whole step
        waiter = asyncio.gather(*acks)

        def on_acked(fut: asyncio.Future[Any]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                delivery.ack()

        waiter.add_done_callback(on_acked)
        self._ack_waiters.add(waiter)
        waiter.add_done_callback(self._ack_waiters.discard)

    def occupied(self, running: int) -> int:
        """The handlers in flight that count against `concurrency`: all of them, unless a
        role knows that some only wait on something other than its own work."""
        return running

    async def run(self) -> None:
        """Default loop: take inputs, handle them concurrently, chain the acks. Told to
        stop, it cancels the handlers in flight (their inputs, unacknowledged, go again)."""
        assert self.ctx.input is not None
        running: set[asyncio.Task[None]] = set()
        stopped = asyncio.ensure_future(self.ctx.stop.wait())
        try:
            while not self.ctx.stop.is_set():
                if self.occupied(len(running)) >= self.concurrency:
                    self.room.clear()
                    room = asyncio.ensure_future(self.room.wait())
                    done, _ = await asyncio.wait(
                        [*running, stopped, room], return_when=asyncio.FIRST_COMPLETED
                    )
                    room.cancel()
                    for task in done - {stopped, room}:
                        running.discard(task)
                        task.result()  # fail the service visibly
                    continue
                try:
                    delivery = await self.ctx.input.get(timeout=0.2)
                except TimeoutError:
                    continue
                running.add(asyncio.create_task(self.process(delivery)))
        finally:  # stopped, cancelled or failed: no handler outlives the loop
            await cancel_and_wait([*running, stopped])


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def _wait_stop(ctx: ServiceContext, main: asyncio.Task[None]) -> None:
    assert ctx.control is not None
    waiters = [
        asyncio.create_task(ctx.stop.wait()),
        asyncio.create_task(ctx.control.shutdown.wait()),
    ]
    done, _ = await asyncio.wait([main, *waiters], return_when=asyncio.FIRST_COMPLETED)
    ctx.stop.set()
    await cancel_and_wait(waiters)
    if main in done:
        main.result()


async def _log_stats(ctx: ServiceContext, service: Service, every_s: float = 5.0) -> None:
    """Queue counters into the log and the metrics file, so a stall is visible."""
    while True:
        await asyncio.sleep(every_s)
        record: dict[str, Any] = {}
        if ctx.input is not None:
            record.update({f"in.{k}": v for k, v in ctx.input.stats.as_dict().items()})
            record["in.buffered"] = ctx.input.buffered
        if ctx.output is not None:
            record.update({f"out.{k}": v for k, v in ctx.output.stats.as_dict().items()})
            record.update({"out.pending": ctx.output.pending, "out.unacked": ctx.output.unacked})
        service.metrics.write({"kind": "queues", **record})
        service.log.debug("queue_stats", **record)


async def serve(
    service_cls: type[Service],
    *,
    controller: str,
    replica: int,
    local_config: PipelineConfig,
    pool: str | None = None,
    ranks: RankLink | None = None,
    early: Any = None,
) -> None:
    """Run one service replica until the run ends or it is told to stop; `pool` places it
    on another pool of the run than the role's (`pipeline service ROLE --pool POOL`).
    `ranks`: this is rank 0 of a sharded service; the other ranks get the run's context
    once the controller answered, and are let go after the teardown."""
    role = service_cls.role
    configure_logging()
    bind_process(service=role, replica=replica)
    log = get_logger("serve")
    control = ControlClient(
        controller, service=role, replica=replica, config=local_config.queues.channel
    )
    out_queue = layout.output_queue(local_config, role)
    hello = Hello(
        service=role,
        replica=replica,
        pid=os.getpid(),
        host=socket.gethostname(),
        endpoints={out_queue: layout.queue_endpoint(local_config, out_queue, replica)}
        if out_queue
        else {},
    )
    answer = await control.handshake(hello, local_config.run.handshake_timeout_s)
    config = config_from_json(answer.config_json)
    if pool is not None:
        try:
            config = layout.place_replica(config, role, pool)
        except Exception:
            await control.close()
            raise
    bind_process(service=role, replica=replica, run_id=answer.run_id)
    ctx = ServiceContext(
        config=config,
        role=role,
        replica=replica,
        run_id=answer.run_id,
        run_dir=Path(answer.run_dir),
        control=control,
        policy_version=answer.policy_version,
        ranks=ranks,
        early=early,
    )
    if ranks is not None:
        await asyncio.to_thread(ranks.lead, context_command(ctx), lambda: None)
    _install_signals(ctx.stop)
    channel = config.queues.channel
    recorder = None
    if out_queue:
        ctx.output = QueueServer(
            out_queue,
            layout.bind_endpoint(config, out_queue, replica),
            run_id=ctx.run_id,
            sender=f"{role}-{replica}",
            config=channel,
        ).start()
    in_queue = layout.input_queue(config, role)
    if in_queue:
        if in_queue in config.queues.record:
            recorder = QueueRecorder(
                queue_path(ctx.run_dir, in_queue), queue=in_queue, run_id=ctx.run_id
            )
        # started (credit granted) after setup: setup may seed its de-duplication
        ctx.input = QueueClient(
            in_queue,
            layout.producer_endpoints(config, in_queue),
            run_id=ctx.run_id,
            consumer=f"{role}-{replica}",
            config=channel,
            recorder=recorder,
        )
    service = service_cls(ctx)
    log.info("service_starting", input=in_queue, output=out_queue)
    stats_task = asyncio.create_task(_log_stats(ctx, service))
    try:
        started = time.time()
        await service.setup()
        # only now the input's credit goes out: setup blocks the loop for seconds (imports,
        # a tokenizer, a checkpoint), so items granted before it would wait on this replica
        # while it sends no heartbeat and its producer declares it dead
        if ctx.input is not None:
            await ctx.input.start()
        # models loaded and warmed up: what a cold start waits for (bench/cold_start)
        log.info("service_ready", setup_s=round(time.time() - started, 3))
        service.metrics.write({"kind": "ready", "start": started, "end": time.time()})
        main = asyncio.create_task(service.run())
        await _wait_stop(ctx, main)
        # told to stop: the main loop ends before the teardown runs (a learner's step in
        # flight may finish); what still runs after half the stop timeout is cancelled
        if not main.done():
            await asyncio.wait([main], timeout=config.supervisor.stop_timeout_s / 2)
            await cancel_and_wait([] if main.done() else [main])
    except Exception:
        log.exception("service_failed")
        raise
    finally:
        stats_task.cancel()
        try:
            await service.teardown()
        finally:
            if ranks is not None:
                await asyncio.to_thread(ranks.stop)
        service.metrics.close()
        for closer in (ctx.input, ctx.output, control):
            if closer is not None:
                await closer.close()
        if recorder is not None:
            recorder.close()
        log.info("service_stopped")


def context_command(ctx: ServiceContext) -> RankCommand:
    """The run rank 0 joined, for the other ranks of its service."""
    run = {"run_id": ctx.run_id, "run_dir": str(ctx.run_dir), "config": config_to_json(ctx.config)}
    return RankCommand(op=RankOp.CONTEXT, version=ctx.policy_version, text=json.dumps(run))


def follow(service_cls: type[Service], *, ranks: RankLink, replica: int, grace_s: float) -> bool:
    """A rank other than 0 of a sharded service: run rank 0's commands until STOP.

    Returns True when rank 0 let it go, False when it left after a SIGTERM/SIGINT that
    rank 0 did not follow with STOP within `grace_s`. The commands run on a thread of their
    own so that signals are seen while it waits in a collective.
    """
    role = service_cls.role
    log = get_logger("follow")
    done = threading.Event()
    failure: list[BaseException] = []

    def loop() -> None:
        try:
            first = ranks.receive()
            if first.op == RankOp.STOP:
                return
            if first.op != RankOp.CONTEXT:
                raise RuntimeError(f"rank 0 sent {RankOp(first.op).name} before the context")
            run = json.loads(first.text)
            ctx = ServiceContext(
                config=config_from_json(run["config"]),
                role=role,
                replica=replica,
                run_id=run["run_id"],
                run_dir=Path(run["run_dir"]),
                policy_version=first.version,
                ranks=ranks,
            )
            bind_process(service=role, replica=replica, rank=ranks.rank, run_id=ctx.run_id)
            worker = service_cls.follower(ctx)
            log.info("following", rank=ranks.rank, world_size=ranks.world)
            while (command := ranks.receive()).op != RankOp.STOP:
                if worker is None:
                    raise RuntimeError(f"{role} has no follower for {RankOp(command.op).name}")
                worker.execute(command)
            log.info("released", rank=ranks.rank)
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    terminated: list[float] = []

    def on_signal(_signum: int, frame: Any) -> None:
        terminated.append(time.monotonic())

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=loop, name="rank-commands", daemon=True).start()
    while not done.wait(0.2):
        if terminated and time.monotonic() - terminated[0] > grace_s:
            log.warning("left_without_stop", rank=ranks.rank, grace_s=grace_s)
            return False
    if failure:
        raise failure[0]
    return True
