"""Kubernetes manifests: a ConfigMap with the profile, a Service for the controller and
one per pool, a shared volume for the run directory, and one workload per role.

The run's layout addresses a pool as one host (every socket bound there uses
`pools.X.host`), so a pool is one node: its pods use the host network, a node selector
puts them on the node labelled `pipeline/pool-X=true`, and a headless Service
`pipeline-pool-X` gives that node a name every pod resolves. Singleton roles (controller,
learner) are Deployments with replica 0; roles with replicas are StatefulSets whose pod
ordinal (label apps.kubernetes.io/pod-index, Kubernetes >= 1.28) is the replica index,
which picks the ports the replica binds.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from pipeline.deploy.chain import TOP, profile_files
from pipeline.deploy.plan import (
    DeployError,
    DeployPlan,
    Launch,
    check_overrides,
    gpus_text,
    note_lines,
)
from pipeline.deploy.ports import pool_ports, queue_port

FILENAME = "k8s.yaml"
IMAGE = "pipeline:latest"
SINGLETONS = ("controller", "learner")
CONTROLLER_SERVICE = "pipeline-controller"
PROFILE_DIR = "/etc/pipeline"
KEYS_DIR = "/etc/pipeline-keys"
RUNS_DIR = "/var/lib/pipeline/runs"
GPU = "nvidia.com/gpu"
KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class _ManifestDumper(yaml.SafeDumper):
    """SafeDumper that indents a list under its key and quotes with double quotes, as the
    Kubernetes documentation writes manifests."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        del indentless  # PyYAML passes it by name; a list is indented under its key anyway
        super().increase_indent(flow, False)

    def choose_scalar_style(self) -> str:
        style = super().choose_scalar_style()
        return '"' if style == "'" else style


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # a profile or script reads best as a literal block (the emitter quotes it where a block
    # cannot hold it); a block would turn NEL or a Unicode line separator into "\n"
    block = "\n" in text and not any(ch in text for ch in "\x85\u2028\u2029")
    style = "|" if block else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def dump_all(documents: list[dict[str, Any]], header: list[str] | None = None) -> str:
    """A multi-document stream: the header as comments, then each document after `---`.
    Keys stay in the order built; no line is folded, so a command reads as one item."""
    text = "".join(f"# {line}".rstrip() + "\n" for line in header or [])
    return text + yaml.dump_all(
        documents,
        Dumper=_ManifestDumper,
        explicit_start=True,
        default_flow_style=False,
        sort_keys=False,
        allow_unicode=True,
        width=2**31 - 1,
    )


def pool_service(pool: str) -> str:
    if not _NAME.fullmatch(pool) or len(pool) > 40:
        raise DeployError(
            f"pool name {pool!r} cannot name a Kubernetes Service; rename the pool with "
            "lowercase letters, digits and '-' (at most 40)"
        )
    return f"pipeline-pool-{pool}"


def node_label(pool: str) -> str:
    return f"pipeline/pool-{pool}"


def _labels(plan: DeployPlan, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "pipeline", "app.kubernetes.io/instance": plan.stem}
    if role is not None:
        labels["app.kubernetes.io/component"] = role
    return labels


def overrides(plan: DeployPlan) -> list[tuple[str, str]]:
    """What every container passes: tcp, node names for the pools, mounted keys and runs.
    CUDA pools list no devices: the device plugin shows each container only its GPUs."""
    out = list(plan.overrides)
    out += [
        ("run.host", pool_service(plan.controller_pool)),
        ("run.keys_dir", KEYS_DIR),
        ("run.runs_dir", RUNS_DIR),
    ]
    for pool in plan.pools:
        out.append((f"pools.{pool.name}.host", pool_service(pool.name)))
        if pool.kind == "cuda":
            out.append((f"pools.{pool.name}.devices", "[]"))
    return out


def _command(plan: DeployPlan, launch: Launch) -> list[str]:
    replica = "0" if launch.role in SINGLETONS else "$(ORDINAL)"
    if launch.nproc > 1:
        command = [
            "torchrun",
            "--nnodes=1",
            f"--nproc-per-node={launch.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{launch.rdzv_port}",
            "-m",
            plan.config.service_module(launch.role),
        ]
    else:
        command = ["pipeline", "service", launch.role]
    command += ["--profile", f"{PROFILE_DIR}/{TOP}", "--replica", replica]
    if launch.role != "controller":
        command += ["--controller", f"tcp://{CONTROLLER_SERVICE}:{plan.port}"]
    for key, value in overrides(plan):
        command += [f"--{key}", value]
    return command


def _wait_for_controller(plan: DeployPlan) -> dict[str, Any]:
    script = (
        "import socket, time\n"
        "while True:\n"
        "    try:\n"
        f"        socket.create_connection(({CONTROLLER_SERVICE!r}, {plan.port}), 2).close()\n"
        "        break\n"
        "    except OSError:\n"
        "        time.sleep(2)\n"
    )
    return {"name": "wait-for-controller", "image": IMAGE, "command": ["python", "-c", script]}


def _container(plan: DeployPlan, launch: Launch) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "PIPELINE_LOG_JSON", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if launch.role not in SINGLETONS:
        index = "metadata.labels['apps.kubernetes.io/pod-index']"
        env.append({"name": "ORDINAL", "valueFrom": {"fieldRef": {"fieldPath": index}}})
    resources: dict[str, Any] = {
        "requests": {"cpu": str(max(1, plan.config.run.torch_threads) * launch.nproc)}
    }
    mounts = [
        {"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True},
        {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
        {"name": "runs", "mountPath": RUNS_DIR},
    ]
    if plan.pool(launch.pool).kind == "cuda":
        resources["limits"] = {GPU: launch.gpus}
        # pods share the node's network: a per-pod NCCL host id keeps NCCL off the
        # shared-memory paths that only work inside one pod
        field = {"fieldRef": {"fieldPath": "metadata.name"}}
        env.append({"name": "NCCL_HOSTID", "valueFrom": field})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": launch.role,
        "image": IMAGE,
        "command": _command(plan, launch),
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
    }
    if launch.role == "controller":
        container["readinessProbe"] = {
            "tcpSocket": {"port": plan.port},
            "periodSeconds": 5,
            "failureThreshold": 360,
        }
    return container


def _volumes(plan: DeployPlan, launch: Launch) -> list[dict[str, Any]]:
    items = [{"key": name, "path": name} for name in KEY_FILES]
    items.append({"key": "client.key", "path": "authorized/client.key"})
    volumes: list[dict[str, Any]] = [
        {"name": "profile", "configMap": {"name": "pipeline-profile"}},
        {"name": "keys", "secret": {"secretName": "pipeline-keys", "items": items}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": "pipeline-runs"}},
    ]
    if plan.pool(launch.pool).kind == "cuda":
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    return volumes


def _node_selector(plan: DeployPlan, pool: str) -> dict[str, str]:
    return {node_label(pool): "true"}


def workload(plan: DeployPlan, role: str) -> dict[str, Any]:
    launches = [launch for launch in plan.launches if launch.role == role]
    first = launches[0]
    pod_labels = {**_labels(plan, role), "pipeline/pool": first.pool}
    pod: dict[str, Any] = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": _node_selector(plan, first.pool),
    }
    if role != "controller":
        pod["initContainers"] = [_wait_for_controller(plan)]
    pod["containers"] = [_container(plan, first)]
    pod["volumes"] = _volumes(plan, first)
    spec: dict[str, Any] = {
        "replicas": len(launches),
        "selector": {"matchLabels": _labels(plan, role)},
    }
    if role in SINGLETONS:
        kind = "Deployment"
        spec["strategy"] = {"type": "Recreate"}
    else:
        kind = "StatefulSet"
        spec["serviceName"] = pool_service(first.pool)
        spec["podManagementPolicy"] = "Parallel"
    spec["template"] = {"metadata": {"labels": pod_labels}, "spec": pod}
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": f"pipeline-{role}", "labels": _labels(plan, role)},
        "spec": spec,
    }


def _service_ports(ports: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"name": name, "port": port, "protocol": "TCP"} for name, port in ports]


def manifests(plan: DeployPlan) -> list[dict[str, Any]]:
    check_overrides(plan, overrides(plan))
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "pipeline-profile", "labels": _labels(plan)},
            "data": profile_files(plan.profile),
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": CONTROLLER_SERVICE, "labels": _labels(plan, "controller")},
            "spec": {
                "type": "ClusterIP",
                "selector": _labels(plan, "controller"),
                "ports": _service_ports(
                    [("control", plan.port), ("prompts-0", queue_port(plan, "prompts", 0))]
                ),
            },
        },
    ]
    for pool in plan.pools:
        spec: dict[str, Any] = {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {**_labels(plan), "pipeline/pool": pool.name},
        }
        ports = pool_ports(plan, pool.name)
        if ports:
            spec["ports"] = _service_ports(ports)
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": pool_service(pool.name), "labels": _labels(plan)},
                "spec": spec,
            }
        )
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "pipeline-runs", "labels": _labels(plan)},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "100Gi"}},
            },
        }
    )
    roles = list(dict.fromkeys(launch.role for launch in plan.launches))
    docs += [workload(plan, role) for role in roles]
    return docs


def render_k8s(plan: DeployPlan) -> str:
    header = [
        f"Run {plan.config.run.name!r} of {plan.profile} on Kubernetes (>= 1.28).",
        f"Rendered by `pipeline deploy render --profile {plan.profile} --target k8s`:",
        "edit the profile and render again (tests/deploy fails while this file is stale).",
        f"Before `kubectl apply -f deploy/{plan.stem}/{FILENAME}`: set the image ({IMAGE}),",
        "label one node per pool, create the CURVE key Secret (`pipeline keys keys`, then",
        "`kubectl create secret generic pipeline-keys --from-file=keys/`); see deploy/README.md.",
        *[f"{node_label(p.name)}=true: {_pool_line(plan, p.name)}" for p in plan.pools],
        *[line[2:] for note in plan.notes for line in note_lines(note)],
    ]
    return dump_all(manifests(plan), header)


def _pool_line(plan: DeployPlan, pool: str) -> str:
    roles = dict.fromkeys(launch.role for launch in plan.launches_on(pool))
    gpus = sum(launch.gpus for launch in plan.launches_on(pool))
    where = gpus_text(gpus) if gpus else "CPU"
    line = f"the node of pool {pool}, {where}: {', '.join(roles)}"
    if gpus > plan.pool(pool).gpus:
        line += f" (the profile shares {plan.pool(pool).gpus}; each pod gets its own)"
    return line
