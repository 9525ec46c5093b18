"""How services that share one GPU share it: CUDA MPS, turns, or the driver's time-slicing.

Separate processes on one GPU take turns by default (time-slicing): a decode step waits
for the learner's kernels and the reverse, and an asynchronous run is no faster than a
synchronous one. Under CUDA MPS their kernels run side by side on the GPU's SMs. Each
service's `services.ROLE.gpu_priority` (CUDA_MPS_CLIENT_PRIORITY; by default below normal
for all but the rollout) lets decode's small kernels take the SMs first. The supervisor
starts a control daemon of its own (its pipe and log directories in a private temporary
directory) before the services and stops it after them. With "turns" the learner instead
pauses the engines while it trains a step; they resume, their running samples kept, once
that step's weights are applied (docs/architecture.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipeline.config import PipelineConfig
from pipeline.config.schema import GPU_PRIORITIES, ROLES
from pipeline.errors import ConfigError
from pipeline.log import get_logger

MPS_CONTROL = "nvidia-cuda-mps-control"
# why auto takes time-slicing at staleness 0: nothing runs beside generation then, and an
# SM share would only slow the trainer down
SYNC_REASON = "staleness 0: generation and training take turns"
# MPS was measured for decode beside training, not for two trainers
NO_ROLLOUT_REASON = "no rollout among them: time-slicing"
DEFAULT_PIPE = "/tmp/nvidia-mps"  # where a daemon started without CUDA_MPS_PIPE_DIRECTORY listens


def shared_gpus(config: PipelineConfig) -> dict[str, list[str]]:
    """Each GPU ("host:device") that more than one service process uses, with those
    processes' names."""
    users: dict[str, list[str]] = defaultdict(list)
    for role in ROLES:
        if role not in config.services:
            continue
        pool = config.pools[config.services[role].pool]
        for replica in range(config.replicas(role)):
            for device in config.devices(role, replica):
                users[f"{pool.host}:{device}"].append(f"{role}-{replica}")
    return {gpu: names for gpu, names in users.items() if len(names) > 1}


def takes_turns(config: PipelineConfig) -> bool:
    """Whether the learner pauses the engines while it trains (`run.gpu_sharing` turns;
    auto does not take it: it lost to MPS on the long-tail workload, docs/performance.md)."""
    return config.run.gpu_sharing == "turns"


@dataclass
class GpuSharing:
    """The choice for a run: `mode` is "turns", "mps" or "time-slice", `reason` says why."""

    mode: str
    reason: str
    priorities: dict[str, int] = field(default_factory=dict)  # role -> MPS client priority
    directory: str = ""  # the run's own daemon's
    running: str = ""  # the pipe directory of a daemon already running: the services use it

    def apply(self, env: dict[str, str], role: str) -> None:
        """A service's environment under this choice."""
        if self.mode != "mps":
            return
        if self.running:
            env["CUDA_MPS_PIPE_DIRECTORY"] = self.running
        else:
            env["CUDA_MPS_PIPE_DIRECTORY"] = f"{self.directory}/pipe"
            env["CUDA_MPS_LOG_DIRECTORY"] = f"{self.directory}/log"
        if self.priorities.get(role):
            env["CUDA_MPS_CLIENT_PRIORITY"] = str(self.priorities[role])
        else:
            env.pop("CUDA_MPS_CLIENT_PRIORITY", None)

    def daemon_env(self, environ: dict[str, str]) -> dict[str, str]:
        env = dict(environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = f"{self.directory}/pipe"
        env["CUDA_MPS_LOG_DIRECTORY"] = f"{self.directory}/log"
        return env


def _names(shared: dict[str, list[str]]) -> set[str]:
    return {name for names in shared.values() for name in names}


def client_priority(config: PipelineConfig, role: str) -> int:
    """CUDA_MPS_CLIENT_PRIORITY of a role: its `gpu_priority`, where "auto" is below normal
    for every role but the rollout (decode is a chain of small kernels that waits for free
    SMs; training's large ones fill the SMs around it)."""
    wanted = config.services[role].gpu_priority
    if wanted == "auto":
        wanted = "normal" if role == "rollout" else "below_normal"
    return GPU_PRIORITIES[wanted]


def running_daemon(environ: Mapping[str, str]) -> str:
    """The pipe directory of an MPS daemon that runs already (the user's or the host's),
    or ""."""
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY", "") or DEFAULT_PIPE
    return pipe if os.path.exists(os.path.join(pipe, "control")) else ""


def choose(
    config: PipelineConfig,
    which: Callable[[str], str | None] = shutil.which,
    environ: Mapping[str, str] = os.environ,
) -> GpuSharing:
    """What `run.gpu_sharing` means for this config on this host, before any daemon runs.
    "mps" where it cannot be honoured is a ConfigError. "auto" takes MPS where services
    share a GPU at staleness >= 1 and the MPS tools are there, time-slicing otherwise, with
    the reason. An MPS daemon that runs already is used, not started again: the services
    are its clients anyway."""
    wanted = config.run.gpu_sharing
    shared = shared_gpus(config)
    sharing = {name.rpartition("-")[0] for name in _names(shared)}
    priorities = {role: p for role in sorted(sharing) if (p := client_priority(config, role))}
    if wanted == "time-slice":
        return GpuSharing("time-slice", "run.gpu_sharing = time-slice")
    if takes_turns(config):
        return GpuSharing("turns", "run.gpu_sharing = turns")
    if not shared:
        if wanted == "mps":
            raise ConfigError(
                "run.gpu_sharing = mps but no GPU is shared by two services; use auto or time-slice"
            )
        return GpuSharing("time-slice", "no GPU is shared by two services")
    gpus = ", ".join(f"{gpu} ({' '.join(names)})" for gpu, names in sorted(shared.items()))
    if running := running_daemon(environ):
        return GpuSharing(
            "mps",
            f"shared GPUs: {gpus}; the MPS daemon at {running}",
            priorities=priorities,
            running=running,
        )
    if wanted == "auto" and config.controller.max_staleness == 0:
        return GpuSharing("time-slice", f"shared GPUs: {gpus}; {SYNC_REASON}")
    if wanted == "auto" and not any(n.startswith("rollout-") for n in _names(shared)):
        return GpuSharing("time-slice", f"shared GPUs: {gpus}; {NO_ROLLOUT_REASON}")
    if which(MPS_CONTROL) is None:
        if wanted == "mps":
            raise ConfigError(
                f"run.gpu_sharing = mps but {MPS_CONTROL} is not on PATH; install the "
                "CUDA driver's MPS tools or set run.gpu_sharing = time-slice"
            )
        return GpuSharing("time-slice", f"{MPS_CONTROL} not found")
    return GpuSharing("mps", f"shared GPUs: {gpus}", priorities)


class MpsDaemon:
    """A private MPS control daemon for one run, started and stopped by the supervisor."""

    def __init__(self, sharing: GpuSharing, environ: dict[str, str]) -> None:
        self.sharing = sharing
        self.environ = environ
        self.log = get_logger("gpu_sharing")
        self.started = False

    def start(self, *, required: bool) -> GpuSharing:
        """Start the daemon; returns the sharing in force (time-slicing with the reason
        when the daemon would not start and MPS was not required)."""
        self.sharing.directory = tempfile.mkdtemp(prefix="pipeline-mps-")
        env = self.sharing.daemon_env(self.environ)
        try:
            proc = subprocess.run(
                [MPS_CONTROL, "-d"], env=env, capture_output=True, text=True, timeout=30
            )
            failure = "" if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()
            failure = failure or (f"exit code {proc.returncode}" if proc.returncode else "")
        except (OSError, subprocess.TimeoutExpired) as err:
            failure = str(err)
        if failure:
            shutil.rmtree(self.sharing.directory, ignore_errors=True)
            if required:
                raise ConfigError(f"run.gpu_sharing = mps: {MPS_CONTROL} -d failed: {failure}")
            return GpuSharing("time-slice", f"{MPS_CONTROL} -d failed: {failure}")
        self.started = True
        return self.sharing

    def stop(self) -> None:
        """Quit the daemon (its server exits once the services have) and remove its
        directory. Idempotent."""
        if not self.started:
            return
        self.started = False
        try:
            subprocess.run(
                [MPS_CONTROL],
                input="quit\n",
                env=self.sharing.daemon_env(self.environ),
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            self.log.warning("mps_quit_failed", error=str(err))
        shutil.rmtree(self.sharing.directory, ignore_errors=True)
