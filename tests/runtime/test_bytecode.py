"""Bytecode for the services where the installed packages hold none (runtime/bytecode.py)."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.bytecode import bytecode_cache


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """A package `bcpkg` with no bytecode beside its source, importable here."""
    root = tmp_path / "site"
    (root / "bcpkg").mkdir(parents=True)
    (root / "bcpkg" / "__init__.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(root))
    return root


def _import(site: Path, env: dict[str, str]) -> None:
    env = {**env, "PYTHONPATH": str(site)}
    code = "import bcpkg; assert bcpkg.VALUE == 3"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def _pycs(top: Path) -> list[Path]:
    return sorted(top.rglob("*.pyc")) if top.exists() else []


def test_without_bytecode_writes_the_services_cache_writes_it_under_the_compile_cache(
    package, tmp_path
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    _import(package, env)
    assert _pycs(package) == []  # what a service met: every start compiles from source
    cache = bytecode_cache(str(tmp_path / "cc"), env, package="bcpkg")
    assert cache is not None
    assert cache.prefix == str(tmp_path / "cc" / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" in cache.reason
    cache.apply(env)
    _import(package, env)
    written = [p for p in _pycs(tmp_path / "cc" / "pycache") if p.parent.name == "bcpkg"]
    assert [p.name.split(".")[0] for p in written] == ["__init__"]
    assert _pycs(package) == []


def test_read_only_packages_get_the_cache(package, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes to read-only directories: nothing to detect")
    (package / "bcpkg").chmod(0o555)
    try:
        cache = bytecode_cache(str(tmp_path / "cc"), {}, package="bcpkg")
    finally:
        (package / "bcpkg").chmod(0o755)
    assert cache is not None and "read-only" in cache.reason


def test_no_cache_where_python_caches_itself_or_the_user_chose(package, tmp_path):
    root = str(tmp_path / "cc")
    # writable and allowed: Python writes the bytecode beside the source on first import
    assert bytecode_cache(root, {}, package="bcpkg") is None
    flag = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert bytecode_cache(root, {**flag, "PYTHONPYCACHEPREFIX": "/x"}, package="bcpkg") is None
    assert bytecode_cache("", flag, package="bcpkg") is None
    assert bytecode_cache(root, flag, package="no_such_package_here") is None
    py_compile.compile(str(package / "bcpkg" / "__init__.py"))
    assert bytecode_cache(root, flag, package="bcpkg") is None
