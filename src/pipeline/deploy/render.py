"""`pipeline deploy render`: a profile's deployment files for one target."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.deploy.k8s import FILENAME as K8S_FILE
from pipeline.deploy.k8s import render_k8s
from pipeline.deploy.plan import DeployError, DeployPlan, load_plan
from pipeline.deploy.slurm import FILENAME as SLURM_FILE
from pipeline.deploy.slurm import render_slurm

TARGETS: dict[str, tuple[str, Callable[[DeployPlan], str]]] = {
    "slurm": (SLURM_FILE, render_slurm),
    "k8s": (K8S_FILE, render_k8s),
}


def render(profile: str | Path, target: str) -> tuple[str, str]:
    """(file name, text) of `target`'s deployment of `profile`."""
    if target not in TARGETS:
        raise DeployError(f"unknown deploy target {target!r}; choose one of {sorted(TARGETS)}")
    filename, render_target = TARGETS[target]
    return filename, render_target(load_plan(profile))


def default_out(profile: str | Path) -> Path:
    return Path("deploy") / Path(str(profile)).stem


def write(profile: str | Path, target: str, out: str | Path | None = None) -> Path:
    filename, text = render(profile, target)
    folder = Path(out) if out is not None else default_out(profile)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_text(text)
    if target == "slurm":
        path.chmod(0o755)
    return path
