"""Deployment files rendered from a profile: a Slurm heterogeneous job, Kubernetes manifests."""

from pipeline.deploy.plan import DeployError, DeployPlan, load_plan, make_plan
from pipeline.deploy.render import TARGETS, default_out, render, write

__all__ = [
    "TARGETS",
    "DeployError",
    "DeployPlan",
    "default_out",
    "load_plan",
    "make_plan",
    "render",
    "write",
]
