"""The Slurm job of every profile, read back and checked against the profile."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pipeline.config.schema import ROLES
from pipeline.deploy import write
from pipeline.deploy.plan import DEFAULT_PORT
from tests.deploy.parse import PROFILES, REPO, load, parse_slurm, slurm_values, used_pools


@pytest.fixture
def render(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def make(profile):
        path = write(profile.relative_to(REPO), "slurm", tmp_path / profile.stem)
        return path, parse_slurm(path.read_text())

    return make


def expected_gpus(config, pool_name: str) -> int:
    """The node's GPU count: the highest position in the pool's device list used + 1."""
    pool = config.pools[pool_name]
    positions = [
        pool.devices.index(d)
        for role in ROLES
        if config.replicas(role) and config.services[role].pool == pool_name
        for r in range(config.replicas(role))
        for d in config.devices(role, r)
    ]
    return max(positions) + 1


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_one_component_per_pool_and_one_srun_per_replica(profile, render):
    path, job = render(profile)
    config = load(profile)
    pools = used_pools(config)
    assert len(job.components) == len(pools)
    # each pool's host is one component's node; the component order is the het group
    group_of = {
        key.split(".")[1]: job.host_groups[value]
        for key, value in job.overrides.items()
        if key.startswith("pools.") and key.endswith(".host")
    }
    assert set(group_of) == pools
    assert sorted(group_of.values()) == list(range(len(pools)))
    assert group_of[config.services["controller"].pool] == 0
    seen = [(s.role, s.replica) for s in job.sruns]
    wanted = [(r, i) for r in ROLES for i in range(config.replicas(r))]
    assert sorted(seen) == sorted(wanted)
    assert len(seen) == len(set(seen))
    assert job.sruns[0].role == "controller"
    for srun in job.sruns:
        assert srun.group == group_of[config.services[srun.role].pool]
        assert srun.option("--profile") == "$PROFILE"
        if srun.role != "controller":
            port = config.run.controller_port or DEFAULT_PORT
            assert srun.option("--controller") == f"tcp://$CONTROLLER_HOST:{port}"
    assert job.variables["PROFILE"] == f"profiles/{profile.name}"
    for component in job.components:
        assert component["--nodes"] == "1"
    assert path.stat().st_mode & 0o111


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_gpus_follow_the_placement(profile, render):
    _, job = render(profile)
    config = load(profile)
    deployed = load(profile, slurm_values(job.overrides))
    group_of = {
        key.split(".")[1]: job.host_groups[value]
        for key, value in job.overrides.items()
        if key.endswith(".host") and key.startswith("pools.")
    }
    for name, group in group_of.items():
        component = job.components[group]
        if config.pools[name].kind == "cpu":
            assert "--gpus-per-node" not in component
            assert "--gres" not in component
        else:
            assert int(component["--gpus-per-node"]) == expected_gpus(config, name)
    for srun in job.sruns:
        placement = config.services[srun.role]
        gpus = int(job.components[srun.group].get("--gpus-per-node", 0))
        pinned = deployed.devices(srun.role, srun.replica)
        # the same number of GPUs as the profile pins, inside the node's allocation
        assert len(pinned) == len(config.devices(srun.role, srun.replica))
        assert all(0 <= d < gpus for d in pinned)
        if config.ranks_per_replica(srun.role) > 1:  # a sharded trainer, a TP engine
            assert srun.nproc == config.ranks_per_replica(srun.role)
            assert srun.nproc == (
                placement.fsdp_size if srun.role in ("learner", "critic") else placement.tp
            )
            assert srun.option("--rdzv-endpoint").startswith(f"$HOST_{srun.group}:")
        else:
            assert srun.nproc == 1


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_the_deployed_config_is_tcp_and_valid(profile, render):
    _, job = render(profile)
    config = load(profile)
    deployed = load(profile, slurm_values(job.overrides))
    assert deployed.run.transport == "tcp"
    assert deployed.run.controller_port == (config.run.controller_port or DEFAULT_PORT)
    assert deployed.run.keys_dir
    if config.run.transport == "ipc":
        assert job.overrides["run.transport"] == "tcp"
        assert "# note: the profile sets run.transport = 'ipc'" in job.text
    else:
        assert "run.transport" not in job.overrides
    lines = job.text.splitlines()
    assert "set -euo pipefail" in lines
    assert lines[-1] == "wait"
    assert lines[0] == "#!/bin/bash"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_the_script_is_valid_bash(profile, render):
    path, _ = render(profile)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_every_step_restarts_its_service_as_a_local_run(profile, render):
    """A process under `pipeline service ROLE --supervise` (the local supervisor's rules), a
    torchrun with `--max-restarts`: both within supervisor.max_restarts."""
    _, job = render(profile)
    limit = load(profile).supervisor.max_restarts
    for srun in job.sruns:
        if srun.nproc > 1:
            assert f"--max-restarts={limit}" in srun.words, srun.words
        else:
            start = srun.words.index("service")
            assert srun.words[start + 2] == "--supervise", srun.words
