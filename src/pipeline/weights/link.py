"""Wiring between the learner's trainer and the rollout engines' weights.

The learner hosts a `WeightHub` at an address derived from the config (like every other
socket of the run); each rollout replica registers a `WeightReceiver` there. After every
step the learner publishes the new version in buckets (gloo on CPU, NCCL between GPUs,
CUDA IPC on a shared GPU); each engine copies it from the receiver's staging tensors into
its live weights between two steps, and only then acknowledges it (WeightDone) and reports
the version as serving. A sharded learner publishes from every rank (each joins the FSDP
gathers; rank 0 alone talks to the engines): rank 0 sends its other ranks the PUBLISH
command first (`runtime/ranks.py`), including for a publish an engine's (re)registration
starts between steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeline.config import PipelineConfig
from pipeline.runtime import layout


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
    ranks on one device), else NCCL between GPUs / gloo on CPU; striped senders when the
    learner has several ranks and a collective transport; the bucket size and deadlines
    from `learner.weights`."""
    from pipeline.weights import PublishConfig
    from pipeline.weights import config as deadlines
    from pipeline.weights.config import SyncTimeouts

    shared = config.shares_device("rollout", "learner")
    section = config.learner.weights
    return PublishConfig(
        bucket_mb=section.bucket_mb,
        dtype=getattr(torch, config.model.dtype),
        striped=config.ranks_per_replica("learner") > 1 and not shared,
        transport="cuda_ipc" if shared else "auto",
        # module constants read now: a test's sitecustomize shortens them
        timeouts=SyncTimeouts(
            bucket_timeout_s=deadlines.BUCKET_TIMEOUT_S,
            apply_timeout_s=deadlines.APPLY_TIMEOUT_S,
        ),
        group=group_options(config, "learner"),
    )


def make_hub(ctx: Any) -> Any:
    """Rank 0's registry of engines, where they can reach it; None without engines."""
    from pipeline.weights import WeightHub

    config = ctx.config
    if config.replicas("rollout") < 1:
        return None
    # the rendezvous store listens where the engines can reach it: the learner's host
    return WeightHub(
        endpoint=hub_endpoint(config),
        store_host=pool_host(config, "learner"),
        run_id=ctx.run_id,
    )


def make_publisher(
    config: PipelineConfig, model: torch.nn.Module | Mapping[str, torch.Tensor], hub: Any
) -> Any:
    """Every learner rank's part of a weight update: rank 0's, with the hub, decides and
    talks to the engines; the others join the FSDP gathers (and send their stripe).
    `model`: the module, or its weights by name (a LoRA learner's merged ones)."""
    from pipeline.weights import WeightPublisher

    return WeightPublisher(model, hub=hub, config=publish_config(config))


def start_receiver(
    ctx: Any,
    model: Any,
    apply: Any,
    version: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    device: Any = None,
    on_pause: Any = None,
) -> Any:
    """An engine rank's side: a receiver thread that hands each complete update to
    `apply(tensors, version)` (the engine's, resolved once it serves them) and acknowledges
    it then. A TP rank registers as `rollout-R.tpK` and keeps its own shards. `model`: the
    engine's module, or its parameters' specs with the `device` to stage them on."""
    from pipeline.weights import WeightReceiver

    name = f"rollout-{ctx.replica}" if tp_size == 1 else f"rollout-{ctx.replica}.tp{tp_rank}"
    receiver = WeightReceiver(
        name,
        hub_endpoint(ctx.config),
        model,
        apply,
        replica=ctx.replica,
        tp_rank=tp_rank,
        tp_size=tp_size,
        options=group_options(ctx.config, "rollout"),
        timeouts=publish_config(ctx.config).timeouts,
        run_id=ctx.run_id,
        version=version,
        device=device,
        on_pause=on_pause,
    )
    receiver.start()
    return receiver


def runner_receiver(ctx: Any, runner: Any) -> Any:
    """The receiver of the engine an EngineRunner drives (on a TP replica's leader, rank
    0's shards): it validates against the engine's own parameters (vLLM's: their
    checkpoint-format specs, staged on its device)."""
    engine = runner.engine
    if hasattr(engine, "weight_params"):
        params, device = engine.weight_params(), engine.device
    else:
        params, device = engine.model, None
    ranks = ctx.ranks
    return start_receiver(
        ctx,
        params,
        runner.update_weights,
        runner.version,
        tp_rank=0,
        tp_size=1 if ranks is None else ranks.world,
        device=device,
        on_pause=runner.pause,
    )
