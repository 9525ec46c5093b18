"""The TCP ports each pool's node listens on, derived like the run's own layout."""

from __future__ import annotations

import dataclasses

from pipeline.config import PipelineConfig
from pipeline.config.schema import QUEUES
from pipeline.deploy.plan import HUB_OFFSET, DeployPlan
from pipeline.runtime import layout


def _tcp_config(plan: DeployPlan) -> PipelineConfig:
    run = dataclasses.replace(plan.config.run, transport="tcp", controller_port=plan.port)
    return dataclasses.replace(plan.config, run=run)


def queue_port(plan: DeployPlan, queue: str, replica: int) -> int:
    return int(layout.queue_endpoint(_tcp_config(plan), queue, replica).rsplit(":", 1)[1])


def pool_ports(plan: DeployPlan, pool: str) -> list[tuple[str, int]]:
    """(name, port) of every socket bound on the pool's node: control, queues, weight hub."""
    ports: list[tuple[str, int]] = []
    if plan.controller_pool == pool:
        ports.append(("control", plan.port))
    for queue in QUEUES:
        producer = layout.PRODUCER_OF[queue]
        if producer in plan.config.services and plan.config.services[producer].pool == pool:
            for replica in range(plan.config.replicas(producer)):
                ports.append((f"{queue}-{replica}", queue_port(plan, queue, replica)))
    if plan.config.services["learner"].pool == pool:
        ports.append(("weights", plan.port + HUB_OFFSET))
    return ports
