"""The files in deploy/ are what the renderer makes now, and every one of them parses."""

from __future__ import annotations

import pytest

from pipeline.deploy import TARGETS, render
from tests.deploy.parse import PROFILES, REPO, load, parse_k8s, parse_slurm, used_pools

DEPLOY = REPO / "deploy"
FILES = sorted(p for p in DEPLOY.glob("*/*") if p.is_file())
TARGET_OF = {filename: target for target, (filename, _) in TARGETS.items()}
MULTI_POOL = sorted(p.stem for p in PROFILES if len(used_pools(load(p))) > 1)


def test_every_multi_pool_profile_is_committed_for_every_target():
    assert MULTI_POOL, "no multi-pool profile in profiles/"
    folders = sorted(p.name for p in DEPLOY.iterdir() if p.is_dir())
    assert folders == MULTI_POOL
    for stem in MULTI_POOL:
        names = sorted(p.name for p in (DEPLOY / stem).iterdir())
        assert names == sorted(TARGET_OF), f"deploy/{stem}/ should hold {sorted(TARGET_OF)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_file_is_up_to_date(path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert path.name in TARGET_OF, f"{path} is not a rendered deploy file"
    _, text = render(f"profiles/{path.parent.name}.toml", TARGET_OF[path.name])
    assert path.read_text() == text, (
        f"{path.relative_to(REPO)} is stale: run `pipeline deploy render --profile "
        f"profiles/{path.parent.name}.toml --target {TARGET_OF[path.name]}`"
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_file_parses(path):
    config = load(REPO / "profiles" / f"{path.parent.name}.toml")
    if TARGET_OF[path.name] == "slurm":
        job = parse_slurm(path.read_text())
        assert len(job.components) == len(used_pools(config))
        assert len(job.sruns) == sum(config.replicas(r) for r in config.services)
    else:
        docs = parse_k8s(path.read_text())
        kinds = [d["kind"] for d in docs]
        assert kinds.count("Deployment") + kinds.count("StatefulSet") == sum(
            1 for r in config.services if config.replicas(r) > 0
        )
