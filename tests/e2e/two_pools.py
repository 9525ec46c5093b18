"""What the runs across two device pools share (the network-namespace and Slurm tests): the
`pipeline` command and a profile placing controller and learner in pool a, rollout and reward
in pool b."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.transport.channel import free_tcp_port

REPO = Path(__file__).resolve().parents[2]


def pipeline_command() -> list[str]:
    script = Path(sys.executable).with_name("pipeline")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipeline.cli"]


def two_pool_profile(
    path: Path,
    *,
    name: str,
    hosts: tuple[str, str],
    keys: Path,
    steps: int,
    run_extra: str = "",
    controller_extra: str = "",
) -> Path:
    """Write the profile (local-cpu.toml's task and model) at `path`; `run_extra` and
    `controller_extra`: more lines for those sections."""
    path.write_text(
        f"""extends = "{REPO / "profiles/local-cpu.toml"}"

[run]
name = "{name}"
runs_dir = "{path.parent / "runs"}"
controller_port = {free_tcp_port()}
keys_dir = "{keys}"
{run_extra}
[pools.a]
host = "{hosts[0]}"
kind = "cpu"

[pools.b]
host = "{hosts[1]}"
kind = "cpu"

[services.controller]
pool = "a"
[services.learner]
pool = "a"
[services.rollout]
pool = "b"
replicas = 1
[services.reward]
pool = "b"
replicas = 1

[task]
warm_start_steps = 20

[controller]
steps = {steps}
prompts_per_step = 8
max_inflight_prompts = 16
{controller_extra}
[learner.trainer]
total_steps = {steps}
"""
    )
    return path
