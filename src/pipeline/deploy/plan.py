"""What a deployment starts, derived from a profile and nothing else.

A pool is one host in the run's layout (`pools.X.host` gives every socket bound there),
so each pool used by a service becomes one node: one Slurm het-job component, one node
label in Kubernetes. The controller's pool comes first (het group 0); the others follow
in role order. Every replica of every role is one launch; a trainer with fsdp_size > 1
(a built-in engine with tp > 1) is one torchrun launch of that many processes.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import PipelineConfig, load_config
from pipeline.config.schema import ROLES, TRAINER_ROLES
from pipeline.errors import ConfigError

# the controller port a deployment uses when the profile leaves it at 0 (pick a free one)
DEFAULT_PORT = 29400
# torchrun's rendezvous: controller_port + RDZV_OFFSET + index in TRAINER_ROLES; a TP
# engine replica's after them (one port per replica: replicas may share a host)
RDZV_OFFSET = 800


def rdzv_offset(role: str, replica: int) -> int:
    if role in TRAINER_ROLES:
        return RDZV_OFFSET + TRAINER_ROLES.index(role)
    return RDZV_OFFSET + len(TRAINER_ROLES) + replica


# the learner's weight hub: controller_port + 900 (see weight_link.hub_endpoint)
HUB_OFFSET = 900


class DeployError(ConfigError):
    """A profile cannot be deployed as asked; the message says what to change."""


@dataclass(frozen=True)
class Launch:
    """One service replica: one process, or one torchrun of `nproc` processes."""

    role: str
    replica: int
    pool: str
    # node-local GPU indices the replica pins (pool devices renumbered from 0)
    devices: tuple[int, ...]
    nproc: int = 1
    rdzv_port: int = 0

    @property
    def gpus(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class PoolPlan:
    name: str
    group: int
    kind: str
    # GPUs the pool's node must give the job: the highest device index used + 1
    gpus: int
    # the pool's devices renumbered from 0, what the deployed config pins ([] on CPU)
    devices: tuple[int, ...]


@dataclass(frozen=True)
class DeployPlan:
    profile: str
    config: PipelineConfig
    port: int
    pools: tuple[PoolPlan, ...]
    launches: tuple[Launch, ...]
    # (dotted key, value) overrides every target passes to every service
    overrides: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]

    def pool(self, name: str) -> PoolPlan:
        return next(p for p in self.pools if p.name == name)

    def launches_on(self, pool: str) -> list[Launch]:
        return [launch for launch in self.launches if launch.pool == pool]

    @property
    def controller_pool(self) -> str:
        return self.config.services["controller"].pool

    @property
    def stem(self) -> str:
        return Path(self.profile).stem


def deployed_roles(config: PipelineConfig) -> list[str]:
    return [role for role in ROLES if config.replicas(role) > 0]


def used_pools(config: PipelineConfig) -> list[str]:
    """Pools that host a service, the controller's first."""
    names = [config.services["controller"].pool]
    for role in deployed_roles(config):
        pool = config.services[role].pool
        if pool not in names:
            names.append(pool)
    return names


def _pool_size(config: PipelineConfig, name: str) -> int:
    """How many devices a CUDA pool has: the ones it lists, or what its services ask."""
    pool = config.pools[name]
    if pool.devices:
        return len(pool.devices)
    need = [
        config.services[role].replicas * config.services[role].devices_per_replica
        for role in deployed_roles(config)
        if config.services[role].pool == name
    ]
    if max(need, default=0) == 0:
        raise DeployError(
            f"pool {name!r} is cuda but lists no devices and its services set no "
            f"devices_per_replica; set pools.{name}.devices or services.*.devices_per_replica"
        )
    return max(need)


def _renumbered(config: PipelineConfig) -> PipelineConfig:
    """The config with each used CUDA pool's devices as 0..n-1: what a node-local
    allocation (a Slurm component, a container) shows the processes."""
    pools = dict(config.pools)
    for name in used_pools(config):
        if pools[name].kind == "cuda":
            devices = list(range(_pool_size(config, name)))
            pools[name] = dataclasses.replace(pools[name], devices=devices)
    return dataclasses.replace(config, pools=pools)


def _launches(config: PipelineConfig, port: int) -> list[Launch]:
    out = []
    for role in deployed_roles(config):
        placement = config.services[role]
        nproc = config.ranks_per_replica(role)
        for replica in range(placement.replicas):
            out.append(
                Launch(
                    role=role,
                    replica=replica,
                    pool=placement.pool,
                    devices=tuple(config.devices(role, replica)),
                    nproc=nproc,
                    rdzv_port=port + rdzv_offset(role, replica) if nproc > 1 else 0,
                )
            )
    return out


def profile_label(path: Path) -> str:
    """The profile path as the rendered files name it: relative to here when inside."""
    relative = os.path.relpath(path.resolve())
    return Path(relative).as_posix() if not relative.startswith("..") else path.as_posix()


def make_plan(config: PipelineConfig, profile: str) -> DeployPlan:
    overrides: list[tuple[str, str]] = []
    notes: list[str] = []
    if config.run.transport != "tcp":
        overrides.append(("run.transport", "tcp"))
        notes.append(
            f"the profile sets run.transport = {config.run.transport!r} (one host); "
            "services on several hosts talk over tcp, so it is overridden to 'tcp'"
        )
    port = config.run.controller_port
    if port == 0:
        port = DEFAULT_PORT
        overrides.append(("run.controller_port", str(port)))
        notes.append(
            f"the profile leaves run.controller_port at 0 (a free port on one host); "
            f"fixed to {port}; the run's other ports follow it, up to {port + HUB_OFFSET}"
        )
    renumbered = _renumbered(config)
    launches = [launch for launch in _launches(renumbered, port) if launch.role == "controller"]
    launches += [launch for launch in _launches(renumbered, port) if launch.role != "controller"]
    pools = []
    for group, name in enumerate(used_pools(config)):
        pool = renumbered.pools[name]
        used = [d for launch in launches if launch.pool == name for d in launch.devices]
        pools.append(
            PoolPlan(
                name=name,
                group=group,
                kind=pool.kind,
                gpus=max(used) + 1 if used else 0,
                devices=tuple(pool.devices) if pool.kind == "cuda" else (),
            )
        )
    return DeployPlan(
        profile=profile,
        config=config,
        port=port,
        pools=tuple(pools),
        launches=tuple(launches),
        overrides=tuple(overrides),
        notes=tuple(notes),
    )


def load_plan(profile: str | Path) -> DeployPlan:
    from pipeline.config.profile import resolve_profile

    path = resolve_profile(str(profile))
    return make_plan(load_config(path), profile_label(path))


def check_overrides(plan: DeployPlan, overrides: list[tuple[str, str]]) -> None:
    """Load the profile with a target's overrides: the deployed config must validate."""
    try:
        load_config(plan.profile, dict(overrides))
    except ConfigError as exc:
        raise DeployError(f"the deployed config of {plan.profile} is invalid: {exc}") from None


def note_lines(note: str) -> list[str]:
    """A note as shell/YAML comment lines."""
    lines = textwrap.wrap(note, 86)
    return [f"# note: {lines[0]}", *[f"#   {line}" for line in lines[1:]]]


def gpus_text(count: int) -> str:
    return f"{count} GPU{'' if count == 1 else 's'}"
