"""`pipeline deploy render` on the command line, and what it refuses."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pipeline.cli import main
from pipeline.deploy import DeployError, render
from tests.deploy.parse import REPO


def test_render_writes_and_prints_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for target, name in (("slurm", "slurm.sbatch"), ("k8s", "k8s.yaml")):
        args = ["--profile", "profiles/hetero-pools.toml", "--target", target]
        code = main(["deploy", "render", *args, "--out", str(tmp_path)])
        assert code == 0
        assert capsys.readouterr().out.strip() == str(tmp_path / name)
        assert (tmp_path / name).read_text() == render("profiles/hetero-pools.toml", target)[1]


def test_default_out_is_deploy_profile_stem(tmp_path, monkeypatch, capsys):
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", "render", "--profile", "node-8gpu", "--target", "k8s"]) == 0
    assert capsys.readouterr().out.strip() == "deploy/node-8gpu/k8s.yaml"
    assert (tmp_path / "deploy" / "node-8gpu" / "k8s.yaml").is_file()


def test_unknown_target_is_refused(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as info:
        main(["deploy", "render", "--profile", "profiles/h200-x2.toml", "--target", "nomad"])
    assert info.value.code == 2
    assert "invalid choice: 'nomad'" in capsys.readouterr().err
    with pytest.raises(DeployError, match=r"unknown deploy target 'nomad'; choose one of"):
        render("profiles/h200-x2.toml", "nomad")


def test_missing_profile_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["deploy", "render", "--profile", "profiles/nope.toml", "--target", "slurm"])
    assert code == 2
    err = capsys.readouterr().err
    assert "profile profiles/nope.toml not found" in err
    assert not (tmp_path / "deploy").exists()


def test_help_does_not_import_the_renderer():
    code = (
        "import sys; from pipeline import cli; cli._parser().format_help(); "
        "print(sorted(m for m in ('pipeline.deploy', 'pipeline.config', 'torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
