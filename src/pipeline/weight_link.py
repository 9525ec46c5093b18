"""Wiring between the learner's trainer and the rollout engines' weights.

The learner hosts a `WeightHub` at an address derived from the config (like every other
socket of the run); each rollout replica registers a `WeightReceiver` there. After every
step the learner publishes the new version in buckets (gloo on CPU, NCCL between GPUs,
CUDA IPC on a shared GPU); each engine applies it between decode steps and only then
reports the version as serving. A sharded learner publishes from every rank (each joins
the FSDP gathers; rank 0 alone talks to the engines): rank 0 sends its other ranks the
PUBLISH command first (`runtime/ranks.py`), including for a publish an engine's
(re)registration starts between steps.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from pipeline.config import PipelineConfig
from pipeline.log import get_logger
from pipeline.runtime import layout

log = get_logger("weight_link")


def hub_endpoint(config: PipelineConfig) -> str:
    if config.run.transport == "ipc":
        return f"ipc://{layout.socket_dir(config)}/weights.sock"
    return f"tcp://{pool_host(config, 'learner')}:{config.run.controller_port + 900}"


def pool_host(config: PipelineConfig, role: str) -> str:
    """The address `role` is reached at on a tcp run: its pool's host; loopback on ipc."""
    if config.run.transport != "tcp":
        return "127.0.0.1"
    return config.pools[config.services[role].pool].host


def group_options(config: PipelineConfig, role: str) -> Any:
    """Where this side's gloo sockets of the weight group listen: its pool's host, the
    address its peers reach it at. Gloo's default, whatever this machine's hostname
    resolves to, is loopback in a container or a network namespace (then an engine on
    another host is told to connect to its own 127.0.0.1) or the wrong NIC."""
    from pipeline.weights.config import GroupOptions

    if config.run.transport != "tcp":
        return GroupOptions()
    return GroupOptions(hostname=pool_host(config, role))


def publish_config(config: PipelineConfig) -> Any:
    """Rollout dtype; CUDA IPC where learner and engines share a GPU (NCCL cannot put two
    ranks on one device), else NCCL between GPUs / gloo on CPU."""
    from pipeline.weights import PublishConfig

    shared = config.shares_device("rollout", "learner")
    return PublishConfig(
        dtype=getattr(torch, config.model.dtype),
        transport="cuda_ipc" if shared else "auto",
        group=group_options(config, "learner"),
    )


class LearnerWeights:
    """The learner's side: publish after each step, report seconds and GB/s."""

    def __init__(self, ctx: Any, model: torch.nn.Module) -> None:
        from pipeline.weights import WeightHub, WeightPublisher

        self.ctx = ctx
        self.replicas = ctx.config.replicas("rollout")
        config = ctx.config
        # the rendezvous store listens where the engines can reach it: the learner's host
        self.hub = WeightHub(
            endpoint=hub_endpoint(config),
            store_host=pool_host(config, "learner"),
            run_id=ctx.run_id,
        )
        self.publisher = WeightPublisher(model, hub=self.hub, config=publish_config(ctx.config))
        self.version = ctx.policy_version  # the version the engines should serve
        self.ranks = ctx.ranks  # rank 0 of a sharded learner: the other ranks publish too
        self._lock = asyncio.Lock()  # one user of the hub's socket at a time
        self._watch = asyncio.get_running_loop().create_task(self._watch_members())

    async def _watch_members(self, every_s: float = 1.0) -> None:
        """An engine that (re)registers between steps gets the current weights now, not at
        the next step: a restarted engine would otherwise generate with its initial weights
        and every sample would be dropped as stale, so no step would ever come."""
        while True:
            await asyncio.sleep(every_s)
            async with self._lock:
                await asyncio.to_thread(self.hub.poll, 0.0)
                joined = self.hub.changed and bool(self.hub.members)
            if joined:
                log.info("engines_changed", engines=self.hub.names(), version=self.version)
                await self.publish(self.version)

    async def publish(self, version: int) -> dict[str, float]:
        async with self._lock:
            self.version = version
            return await self._publish(version)

    async def _publish(self, version: int) -> dict[str, float]:
        from pipeline.errors import WeightSyncError

        try:
            if self.ranks is None:
                report = await asyncio.to_thread(self.publisher.publish, version)
            else:
                report = await asyncio.to_thread(self._lead_publish, version)
        except WeightSyncError as exc:
            # the old version keeps serving on the engines; the run goes on
            log.error("weight_sync_failed", version=version, error=str(exc))
            return {"sync_failed": 1.0}
        return {
            "sync_seconds": float(report.seconds),
            "sync_gbps": float(report.gbps),
            "sync_bytes": float(report.bytes),
        }

    def _lead_publish(self, version: int) -> Any:
        from pipeline.errors import WeightSyncError
        from pipeline.messages import RankCommand, RankOp

        assert self.ranks is not None
        return self.ranks.lead(
            RankCommand(op=RankOp.PUBLISH, version=version),
            lambda: self.publisher.publish(version),
            agreed=(WeightSyncError,),  # the publisher makes every rank raise it alike
        )

    async def wait_for_engines(self, timeout_s: float) -> None:
        names = await asyncio.to_thread(self.hub.wait_for_members, self.replicas, timeout_s)
        log.info("engines_registered", engines=names)

    async def close(self) -> None:
        self._watch.cancel()
        async with self._lock:
            pass  # a publish in flight finishes first
        self.publisher.close()
        self.hub.close()


async def make_publisher(ctx: Any, model: torch.nn.Module) -> LearnerWeights | None:
    if ctx.config.replicas("rollout") < 1:
        return None
    return LearnerWeights(ctx, model)


def follower_publisher(config: PipelineConfig, model: torch.nn.Module) -> Any:
    """A learner rank other than 0: its part of every publish (the FSDP gathers), with no
    hub; rank 0 decides, talks to the engines and shares the outcome."""
    from pipeline.weights import WeightPublisher

    return WeightPublisher(model, hub=None, config=publish_config(config))


def start_receiver(ctx: Any, runner: Any) -> Any:
    """The engine's side: a receiver thread that stages complete updates into the engine."""
    from pipeline.weights import WeightReceiver

    def apply(tensors: dict[str, torch.Tensor], version: int) -> None:
        runner.update_weights(tensors.items(), version)  # copies; applied at a safe point

    receiver = WeightReceiver(
        f"rollout-{ctx.replica}",
        hub_endpoint(ctx.config),
        runner.engine.model,
        apply,
        replica=ctx.replica,
        options=group_options(ctx.config, "rollout"),
        run_id=ctx.run_id,
        version=runner.version,
    )
    receiver.start()
    return receiver
