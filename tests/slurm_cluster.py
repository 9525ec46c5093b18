"""A Slurm cluster of two nodes on this host, for tests: munged, slurmctld and two slurmd.

Slurm's backfill scheduler, the only one that starts a heterogeneous job, plans each
component on whole nodes: on one node it plans the second component after the first. So the cluster has two
nodes, two slurmd on this host (`slurmd -N NAME`, each on its own port), named after
names this host resolves (its short hostname and `localhost`), because the rendered job
makes each component's node name its pool's address. Everything lives in a temp dir
(config, munge key and socket, state, logs); the daemons run in the foreground as this
process's children and are stopped by pid. Needs root, and the packages slurmd,
slurmctld and munge (installed with apt-get where missing); otherwise `unavailable`
says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.transport.channel import free_tcp_port

PACKAGES = ("slurmd", "slurmctld", "munge")
BINARIES = ("slurmd", "slurmctld", "munged", "sbatch", "sinfo", "squeue", "scancel")
START_TIMEOUT_S = 60.0


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: tuple[str, ...]
    version: str
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def command(self, *args: str, timeout: float = 30) -> str:
        """A Slurm client command against this cluster; its stdout."""
        proc = subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    def logs(self) -> str:
        """The tail of every daemon's log: what a failing test prints."""
        out = []
        for log in sorted(self.root.glob("*.log")):
            out.append(f"--- {log.name}\n" + log.read_text(errors="replace")[-2000:])
        return "\n".join(out)


def installed() -> bool:
    return all(shutil.which(b) for b in BINARIES)


def unavailable() -> str | None:
    """Why a Slurm cluster cannot run here (None: it can); installs the packages first
    where they are missing and apt-get can."""
    if os.geteuid() != 0:
        return "needs root to start munged, slurmctld and slurmd"
    if installed():
        return None
    if shutil.which("apt-get") is None:
        return f"slurm is not installed and there is no apt-get to install {PACKAGES}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = subprocess.run(
        ["apt-get", "install", "-y", *PACKAGES],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if proc.returncode != 0 or not installed():
        return f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr.strip()[-300:]}"
    return None


def _conf(root: Path, nodes: tuple[str, ...], cpus: int) -> str:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=pipelinetest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_tcp_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        # no cgroups in a container: processes tracked by parent pid, no task binding
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1,bf_hetjob_immediate",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "DefMemPerCPU=256",
        # the nodes as configured here, whatever this host has (two slurmd share it)
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MinJobAge=600",
    ]
    for node in nodes:
        lines.append(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_tcp_port()} "
            f"CPUs={cpus} RealMemory=2048"
        )
    lines.append(f"PartitionName=test Nodes={','.join(nodes)} Default=YES State=UP")
    return "\n".join(lines) + "\n"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def slurm_cluster(cpus: int = 2) -> Iterator[SlurmCluster]:
    """Two idle nodes of `cpus` CPUs each; every daemon stopped by pid on the way out."""
    # a short path: the munge socket's must fit sun_path
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    host = socket.gethostname().split(".")[0]
    nodes = (host, "localhost") if host != "localhost" else ("localhost", "127.0.0.1")
    version = subprocess.run(
        ["slurmd", "-V"], capture_output=True, text=True, check=False
    ).stdout.strip()
    cluster = SlurmCluster(root, root / "slurm.conf", nodes, version)
    try:
        (root / "state").mkdir()
        cluster.conf.write_text(_conf(root, nodes, cpus))
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        start = {
            "munged": [
                *("munged", "--foreground", "--force", f"--socket={root}/munge.socket"),
                *(f"--key-file={key}", f"--log-file={root}/munged.log"),
                *(f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed"),
            ],
            "slurmctld": ["slurmctld", "-D", "-i"],
            **{f"slurmd-{node}": ["slurmd", "-D", "-N", node] for node in nodes},
        }
        for name, argv in start.items():
            out = (root / f"{name}.out").open("wb")
            cluster.daemons[name] = subprocess.Popen(
                argv, env=cluster.env, stdout=out, stderr=subprocess.STDOUT
            )
            out.close()
            time.sleep(1.0 if name in ("munged", "slurmctld") else 0.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for name, proc in cluster.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{cluster.logs()}")
            states = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"],
                env=cluster.env,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split()
            if states[1::2] == ["idle"] * len(nodes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle: {states}\n{cluster.logs()}")
            time.sleep(0.5)
        yield cluster
    finally:
        # the nodes first (their job steps end with them), then the controller, munge last
        for name in reversed(list(cluster.daemons)):
            _stop(cluster.daemons[name])
        shutil.rmtree(root, ignore_errors=True)
