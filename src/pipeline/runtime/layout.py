"""Where every socket of a run lives, derived from the config alone.

Producers bind, consumers connect; both sides compute the same addresses, so a service
started by hand on another host finds its peers from the profile and the run name.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from pipeline.config.schema import QUEUES, PipelineConfig
from pipeline.errors import PlacementConflict

# which role produces each queue
PRODUCER_OF = {
    "prompts": "controller",
    "rollouts": "rollout",
    "scored": "reward",
    "experience": "critic",
    "referenced": "reference",
}


def run_dir(config: PipelineConfig) -> Path:
    return Path(config.run.runs_dir).resolve() / config.run.name


def socket_dir(config: PipelineConfig) -> Path:
    """Short, per-run directory for ipc sockets (unix socket paths max out at ~107 bytes)."""
    digest = hashlib.sha1(str(run_dir(config)).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"pipeline-{digest}"


def controller_endpoint(config: PipelineConfig) -> str:
    if config.run.transport == "ipc":
        return f"ipc://{socket_dir(config)}/control.sock"
    return f"tcp://{config.run.host}:{config.run.controller_port}"


def queue_endpoint(config: PipelineConfig, queue: str, replica: int) -> str:
    if config.run.transport == "ipc":
        return f"ipc://{socket_dir(config)}/{queue}-{replica}.sock"
    port = config.run.controller_port + 1 + QUEUES.index(queue) * 100 + replica
    role = PRODUCER_OF[queue]
    host = config.pools[config.services[role].pool].host if role in config.services else "127.0.0.1"
    return f"tcp://{host}:{port}"


def bind_endpoint(config: PipelineConfig, queue: str, replica: int) -> str:
    """What the producer binds: the same port on every interface of its host for tcp."""
    endpoint = queue_endpoint(config, queue, replica)
    if config.run.transport == "tcp":
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{config.pools[config.services[PRODUCER_OF[queue]].pool].host}:{port}"
    return endpoint


def input_queue(config: PipelineConfig, role: str) -> str | None:
    """The chain: controller -> rollout -> reward -> [reference] -> [critic] -> learner."""
    scored = "referenced" if config.replicas("reference") > 0 else "scored"
    if role == "rollout":
        return "prompts"
    if role == "reward":
        return "rollouts"
    if role == "reference":
        return "scored"
    if role == "critic":
        return scored
    if role == "learner":
        return "experience" if config.critic.enabled else scored
    return None


def output_queue(config: PipelineConfig, role: str) -> str | None:
    for queue, producer in PRODUCER_OF.items():
        if producer == role:
            return queue
    return None


def producer_endpoints(config: PipelineConfig, queue: str) -> list[str]:
    role = PRODUCER_OF[queue]
    return [queue_endpoint(config, queue, r) for r in range(config.replicas(role))]


def place_replica(config: PipelineConfig, role: str, pool: str) -> PipelineConfig:
    """The run's config as one replica started with `--pool POOL` uses it: it binds on that
    pool's host and sees that pool's devices. Its peers find it from the run's config alone
    (a producer's queue, the learner's weight hub: at the host of the pool the run places
    the role on), so on tcp the pool must be on that host; the controller, whose config
    is the run's, places itself anywhere (`config.placed_on`)."""
    placed = config.placed_on(role, pool)
    where = config.services[role].pool
    host, mine = config.pools[where].host, config.pools[pool].host
    if config.run.transport == "tcp" and host != mine:
        raise PlacementConflict(
            f"--pool {pool!r} is on host {mine}, but this run places {role} on pool "
            f"{where!r} (host {host}), where its peers connect to it; start the controller "
            f"with --services.{role}.pool {pool}, or pick a pool on host {host}"
        )
    return placed
