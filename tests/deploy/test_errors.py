"""Profiles a deployment cannot honour are refused with the change to make."""

from __future__ import annotations

import pytest

from pipeline.deploy import DeployError, load_plan, render
from tests.deploy.parse import REPO, parse_k8s, parse_slurm

BASE = (REPO / "profiles" / "local-cpu.toml").read_text()


def profile(tmp_path, text: str, name: str = "p.toml"):
    (tmp_path / "local-cpu.toml").write_text(BASE)
    path = tmp_path / name
    path.write_text('extends = "local-cpu.toml"\n' + text)
    return path


def test_cuda_pool_without_devices_or_sizes_is_refused(tmp_path):
    path = profile(tmp_path, '[pools.gpu]\nkind = "cuda"\n[services.rollout]\npool = "gpu"\n')
    with pytest.raises(DeployError, match=r"set pools.gpu.devices or services"):
        load_plan(path)


def test_cuda_pool_without_devices_is_sized_from_its_services(tmp_path):
    path = profile(
        tmp_path,
        '[pools.gpu]\nkind = "cuda"\n'
        '[services.rollout]\npool = "gpu"\nreplicas = 3\ndevices_per_replica = 2\n',
    )
    job = parse_slurm(render(path, "slurm")[1])
    assert job.components[1]["--gpus-per-node"] == "6"
    assert job.overrides["pools.gpu.devices"] == "[0,1,2,3,4,5]"
    rollout = next(d for d in parse_k8s(render(path, "k8s")[1]) if d["kind"] == "StatefulSet")
    limits = rollout["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 2}


def test_pool_names_kubernetes_cannot_use_are_refused(tmp_path):
    path = profile(tmp_path, '[pools.Big_GPU]\nkind = "cpu"\n[services.reward]\npool = "Big_GPU"\n')
    assert render(path, "slurm")  # Slurm does not care
    with pytest.raises(DeployError, match=r"rename the pool with lowercase letters"):
        render(path, "k8s")


def test_profile_extending_another_folder_cannot_be_mounted(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "local-cpu.toml").write_text(BASE)
    path = tmp_path / "p.toml"
    path.write_text('extends = "base/local-cpu.toml"\n')
    assert render(path, "slurm")
    with pytest.raises(DeployError, match=r"move it beside the profile"):
        render(path, "k8s")


def test_hub_port_matches_the_weight_link(tmp_path):
    import dataclasses

    from pipeline.deploy.plan import HUB_OFFSET
    from pipeline.weights.link import hub_endpoint

    plan = load_plan(REPO / "profiles" / "hetero-pools.toml")
    run = dataclasses.replace(plan.config.run, transport="tcp")
    config = dataclasses.replace(plan.config, run=run)
    assert hub_endpoint(config).endswith(f":{plan.port + HUB_OFFSET}")
