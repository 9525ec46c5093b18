"""The Kubernetes manifests of every profile, read back and checked against the profile."""

from __future__ import annotations

import pytest

from pipeline.config.schema import ROLES
from pipeline.deploy import write
from pipeline.deploy.plan import DEFAULT_PORT
from pipeline.runtime import layout
from tests.deploy.parse import PROFILES, REPO, command_overrides, load, parse_k8s, used_pools


@pytest.fixture
def render(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def make(profile):
        path = write(profile.relative_to(REPO), "k8s", tmp_path / profile.stem)
        return parse_k8s(path.read_text())

    return make


def by_kind(docs, kind):
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def workloads(docs):
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def deployed_config(docs, tmp_path, role="controller"):
    """The config a container of `role` loads: the mounted profile and its overrides."""
    for name, text in by_kind(docs, "ConfigMap")["pipeline-profile"]["data"].items():
        (tmp_path / name).write_text(text)
    container = workloads(docs)[f"pipeline-{role}"]["spec"]["template"]["spec"]["containers"][0]
    args, overrides = command_overrides(container["command"])
    assert args["profile"] == "/etc/pipeline/profile.toml"
    return load(tmp_path / "profile.toml", overrides)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_one_workload_per_role(profile, render):
    docs = render(profile)
    config = load(profile)
    port = config.run.controller_port or DEFAULT_PORT
    found = workloads(docs)
    roles = [r for r in ROLES if config.replicas(r) > 0]
    assert sorted(found) == sorted(f"pipeline-{r}" for r in roles)
    for role in roles:
        placement = config.services[role]
        pool = config.pools[placement.pool]
        work = found[f"pipeline-{role}"]
        assert work["spec"]["replicas"] == placement.replicas
        pod = work["spec"]["template"]["spec"]
        assert work["spec"]["selector"]["matchLabels"].items() <= (
            work["spec"]["template"]["metadata"]["labels"].items()
        )
        container = pod["containers"][0]
        args, _ = command_overrides(container["command"])
        env = {e["name"]: e for e in container["env"]}
        if work["kind"] == "StatefulSet":
            assert args["replica"] == "$(ORDINAL)"
            field = env["ORDINAL"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
        else:
            assert placement.replicas == 1
            assert args["replica"] == "0"
        if role == "controller":
            assert "controller" not in args
        else:
            assert args["controller"] == f"tcp://pipeline-controller:{port}"
        limits = container["resources"].get("limits", {})
        selector = pod["nodeSelector"]
        assert selector[f"pipeline/pool-{placement.pool}"] == "true"
        if pool.kind == "cuda":
            want = placement.devices_per_replica or len(pool.devices)
            assert limits["nvidia.com/gpu"] == want
        else:
            assert "nvidia.com/gpu" not in limits
        # the pool's label alone places a pod: the nodes labelled for a pool are its GPUs'
        assert selector == {f"pipeline/pool-{placement.pool}": "true"}
        if config.ranks_per_replica(role) > 1:  # a sharded trainer, a TP engine
            nproc = placement.fsdp_size if role in ("learner", "critic") else placement.tp
            assert container["command"][0] == "torchrun"
            assert f"--nproc-per-node={nproc}" in container["command"]
            assert container["command"][container["command"].index("-m") + 1] == (
                f"services.{role}"
            )
        else:
            assert container["command"][:3] == ["pipeline", "service", role]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_services_expose_every_bound_port(profile, render, tmp_path):
    docs = render(profile)
    config = load(profile)
    port = config.run.controller_port or DEFAULT_PORT
    services = by_kind(docs, "Service")
    controller = services["pipeline-controller"]["spec"]
    assert controller["type"] == "ClusterIP"
    assert port in {p["port"] for p in controller["ports"]}
    assert controller["selector"]["app.kubernetes.io/component"] == "controller"
    deployed = deployed_config(docs, tmp_path)
    assert deployed.run.transport == "tcp" and deployed.run.controller_port == port
    for pool in used_pools(config):
        service = services[f"pipeline-pool-{pool}"]["spec"]
        assert service["clusterIP"] == "None"
        assert deployed.pools[pool].host == f"pipeline-pool-{pool}"
        listed = {p["port"] for p in service.get("ports", [])}
        for role in ROLES:
            queue = layout.output_queue(deployed, role)
            if not config.replicas(role) or config.services[role].pool != pool or not queue:
                continue
            for replica in range(config.replicas(role)):
                bound = layout.bind_endpoint(deployed, queue, replica)
                assert bound.startswith(f"tcp://pipeline-pool-{pool}:")
                assert int(bound.rsplit(":", 1)[1]) in listed
    for work in workloads(docs).values():
        if work["kind"] == "StatefulSet":
            assert work["spec"]["serviceName"] in services


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_the_mounted_profile_is_the_profile(profile, render, tmp_path):
    docs = render(profile)
    config = load(profile)
    deployed = deployed_config(docs, tmp_path)
    assert load(tmp_path / "profile.toml") == config
    # only the deployment's own keys differ from the profile
    assert deployed.run.keys_dir == "/etc/pipeline-keys"
    assert deployed.algorithm == config.algorithm and deployed.learner == config.learner
    for role in ROLES:
        # the device plugin shows each container only its own GPUs
        for replica in range(config.replicas(role)):
            assert deployed.devices(role, replica) == []
    every = [deployed_config(docs, tmp_path, r) for r in ROLES if config.replicas(r)]
    assert all(c == deployed for c in every)
    pvc = by_kind(docs, "PersistentVolumeClaim")["pipeline-runs"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
