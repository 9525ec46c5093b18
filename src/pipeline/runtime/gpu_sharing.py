"""How services that share one GPU share it: CUDA MPS or the driver's time-slicing.

Separate processes on one GPU take turns by default (time-slicing): a decode step waits
for the learner's kernels and the reverse, and an asynchronous run is no faster than a
synchronous one. Under CUDA MPS their kernels run side by side on the GPU's SMs; each
service's `services.ROLE.gpu_share` caps its share of the SMs
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so that training beside it leaves decode the SMs it
needs. The supervisor starts a control daemon of its own (its pipe and log directories in a
private temporary directory) before the services and stops it after them.
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
from pipeline.config.schema import ROLES
from pipeline.errors import ConfigError
from pipeline.log import get_logger

MPS_CONTROL = "nvidia-cuda-mps-control"
# why auto does not start MPS: the one-GPU e2e preset (GRPO, staleness 1, trunk graphs)
# ran 146.7 samples/s time-sliced against 142.2 under MPS and 138.0 with the learner held
# to half the SMs: decode slowed more beside training than training gained
AUTO_REASON = "time-slicing, measured faster than MPS for generation beside training"
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


@dataclass
class GpuSharing:
    """The choice for a run: `mode` is "mps" or "time-slice", `reason` says why."""

    mode: str
    reason: str
    shares: dict[str, int] = field(default_factory=dict)  # role -> SM percentage
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
        if self.shares.get(role):
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.shares[role])
        else:
            env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)

    def daemon_env(self, environ: dict[str, str]) -> dict[str, str]:
        env = dict(environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = f"{self.directory}/pipe"
        env["CUDA_MPS_LOG_DIRECTORY"] = f"{self.directory}/log"
        return env


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
    "mps" where it cannot be honoured is a ConfigError. "auto" takes time-slicing, with the
    reason, unless an MPS daemon runs already: then the services are its clients anyway,
    and it is used, not started again."""
    wanted = config.run.gpu_sharing
    shared = shared_gpus(config)
    shares = {
        role: config.services[role].gpu_share
        for role in config.services
        if config.services[role].gpu_share
    }
    if wanted == "time-slice":
        return GpuSharing("time-slice", "run.gpu_sharing = time-slice")
    if not shared:
        if wanted == "mps":
            raise ConfigError(
                "run.gpu_sharing = mps but no GPU is shared by two services; use auto or time-slice"
            )
        return GpuSharing("time-slice", "no GPU is shared by two services")
    gpus = ", ".join(f"{gpu} ({' '.join(names)})" for gpu, names in sorted(shared.items()))
    if running := running_daemon(environ):
        return GpuSharing(
            "mps", f"shared GPUs: {gpus}; the MPS daemon at {running}", shares, running=running
        )
    if wanted == "auto":  # measured: MPS lost to time-slicing on one H200 (see AUTO_REASON)
        return GpuSharing("time-slice", f"shared GPUs: {gpus}; {AUTO_REASON}")
    if which(MPS_CONTROL) is None:
        if wanted == "mps":
            raise ConfigError(
                f"run.gpu_sharing = mps but {MPS_CONTROL} is not on PATH; install the "
                "CUDA driver's MPS tools or set run.gpu_sharing = time-slice"
            )
        return GpuSharing("time-slice", f"{MPS_CONTROL} not found")
    return GpuSharing("mps", f"shared GPUs: {gpus}", shares)


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
