"""A Slurm heterogeneous job: one component per pool, one `srun` per service replica.

Steps share their component's node with `--overlap` (services of a pool share its GPUs,
as on one host); each replica pins its slice of the pool's devices renumbered from 0,
which is how a node with constrained devices shows the job's GPUs. The other services
start once the controller has prepared the run (it writes run.json, as under `pipeline
run`), and the job ends when the controller does.

A step restarts its service as `pipeline run` does: a process runs under `pipeline service
ROLE --supervise` (`runtime/replica_supervisor.py`, the local supervisor's rules), a
torchrun restarts its ranks itself (`--max-restarts`), up to supervisor.max_restarts.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

from pipeline.deploy.plan import DeployPlan, Launch, check_overrides, gpus_text, note_lines

FILENAME = "slurm.sbatch"
READY_TIMEOUT_S = 900


def _host_var(group: int) -> str:
    return f"HOST_{group}"


def _overrides(plan: DeployPlan) -> list[tuple[str, str]]:
    """Dotted overrides as shell words: literals quoted, node addresses as variables."""
    out = [(key, shlex.quote(value)) for key, value in plan.overrides]
    out += [("run.host", '"$CONTROLLER_HOST"'), ("run.keys_dir", '"$KEYS_DIR"')]
    for pool in plan.pools:
        out.append((f"pools.{pool.name}.host", f'"${_host_var(pool.group)}"'))
        if pool.kind == "cuda":
            devices = "[" + ",".join(str(d) for d in pool.devices) + "]"
            out.append((f"pools.{pool.name}.devices", shlex.quote(devices)))
    return out


def _pool_summary(plan: DeployPlan, name: str) -> str:
    pool = plan.pool(name)
    counts: dict[str, list[Launch]] = {}
    for launch in plan.launches_on(name):
        counts.setdefault(launch.role, []).append(launch)
    parts = []
    for role, launches in counts.items():
        text = role if len(launches) == 1 else f"{role} x{len(launches)}"
        extra = []
        if launches[0].nproc > 1:
            extra.append(f"torchrun x{launches[0].nproc}")
        if launches[0].gpus:
            extra.append(f"{gpus_text(launches[0].gpus)} each")
        parts.append(text + (f" ({', '.join(extra)})" if extra else ""))
    kind = pool.kind if pool.kind == "cpu" else f"cuda, {gpus_text(pool.gpus)}"
    if pool.kind == "cuda" and pool.gpus < len(pool.devices):
        kind += f" of the {len(pool.devices)} it lists"
    return f"het group {pool.group}: pool {name} ({kind}): {', '.join(parts)}"


def _directives(plan: DeployPlan) -> list[str]:
    threads = max(1, plan.config.run.torch_threads)
    name = f"pipeline-{plan.config.run.name}"
    lines = [f"#SBATCH --job-name={name}", f"#SBATCH --output={name}-%j.out"]
    for pool in plan.pools:
        if pool.group > 0:
            lines.append("#SBATCH hetjob")
        processes = sum(launch.nproc for launch in plan.launches_on(pool.name))
        lines += [
            "#SBATCH --nodes=1",
            f"#SBATCH --ntasks={processes}",
            f"#SBATCH --cpus-per-task={threads}",
        ]
        if pool.gpus:
            lines.append(f"#SBATCH --gpus-per-node={pool.gpus}")
    return lines


def _srun(plan: DeployPlan, launch: Launch) -> str:
    pool = plan.pool(launch.pool)
    words = ["srun"]
    if len(plan.pools) > 1:
        words.append(f"--het-group={pool.group}")
    words += ["--overlap", "--nodes=1", "--ntasks=1"]
    if launch.nproc > 1:
        words += [
            "torchrun",
            "--nnodes=1",
            f"--nproc-per-node={launch.nproc}",
            f"--max-restarts={plan.config.supervisor.max_restarts}",
            "--rdzv-backend=c10d",
            f'--rdzv-endpoint="${_host_var(pool.group)}:{launch.rdzv_port}"',
            f'--rdzv-id="$SLURM_JOB_ID-{launch.role}-{launch.replica}"',
            "-m",
            plan.config.service_module(launch.role),
        ]
    else:
        words += ["pipeline", "service", launch.role, "--supervise"]
    words += ["--profile", '"$PROFILE"', "--replica", str(launch.replica)]
    if launch.role != "controller":
        words += ["--controller", f'"tcp://$CONTROLLER_HOST:{plan.port}"']
    words += ['"${OVERRIDES[@]}"', "&"]
    return " ".join(words)


def _run_dir(plan: DeployPlan) -> str:
    return (PurePosixPath(plan.config.run.runs_dir) / plan.config.run.name).as_posix()


def render_slurm(plan: DeployPlan) -> str:
    check_overrides(
        plan,
        [
            (key, "node-0" if "$" in value else shlex.split(value)[0])
            for key, value in _overrides(plan)
        ],
    )
    het = len(plan.pools) > 1
    nodelist = "SLURM_JOB_NODELIST_HET_GROUP_{}" if het else "SLURM_JOB_NODELIST"
    job = "heterogeneous job" if het else "job"
    lines = [
        "#!/bin/bash",
        f"# Run {plan.config.run.name!r} of {plan.profile} as one Slurm {job}.",
        f"# Rendered by `pipeline deploy render --profile {plan.profile} --target slurm`:",
        "# edit the profile and render again (tests/deploy fails while this file is stale).",
        "# Submit from the repository root (a filesystem every node sees), with the",
        "# environment that has `pipeline` active and CURVE keys made by `pipeline keys DIR`:",
        f"#   PIPELINE_KEYS_DIR=DIR sbatch deploy/{plan.stem}/{FILENAME}",
        "# A pool is one host in the run's layout, so each pool is one node (one component):",
        *[f"#   {_pool_summary(plan, pool.name)}" for pool in plan.pools],
        "# Site options (--partition, --account, --time, a GPU type) go below.",
        *_directives(plan),
        "",
        "set -euo pipefail",
        "",
        *[line for note in plan.notes for line in note_lines(note)],
        f"PROFILE={shlex.quote(plan.profile)}",
        f"RUN_DIR={shlex.quote(_run_dir(plan))}",
        f"KEYS_DIR=${{PIPELINE_KEYS_DIR:-{shlex.quote(plan.config.run.keys_dir or 'keys')}}}",
        "export PIPELINE_LOG_JSON=1 PYTHONUNBUFFERED=1",
        "",
        "# each pool's address is the first host of its component",
        *[
            f'{_host_var(p.group)}=$(scontrol show hostnames "${nodelist.format(p.group)}" | head -1)'
            for p in plan.pools
        ],
        f"CONTROLLER_HOST=${_host_var(0)}",
        "OVERRIDES=(",
        *[f"  --{key} {value}" for key, value in _overrides(plan)],
        ")",
        "",
        'rm -f "$RUN_DIR/run.json"',
        _srun(plan, plan.launches[0]),
        "CONTROLLER_PID=$!",
        "# the others join once the controller has prepared the run (data, tokenizer, model)",
        f"for _ in $(seq {READY_TIMEOUT_S}); do",
        '  [ -f "$RUN_DIR/run.json" ] && break',
        '  kill -0 "$CONTROLLER_PID" 2>/dev/null || { echo "controller exited early" >&2; exit 1; }',
        "  sleep 1",
        "done",
        f'[ -f "$RUN_DIR/run.json" ] || {{ echo "controller not ready in {READY_TIMEOUT_S} s" >&2; exit 1; }}',
        "sleep 1",
        *[_srun(plan, launch) for launch in plan.launches[1:]],
        "",
        "# the run ends with the controller, which tells every service to stop",
        'wait "$CONTROLLER_PID"',
        "wait",
    ]
    return "\n".join(lines) + "\n"
