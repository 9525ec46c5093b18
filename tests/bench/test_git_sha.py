"""The commit a bench result names: HEAD, marked "+dirty" when tracked files differ from it,
or the $PIPELINE_GIT_SHA a copied tree is run with."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from bench.common import git_sha


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_head_then_dirty_then_the_given_sha(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PIPELINE_GIT_SHA", raising=False)
    assert git_sha(tmp_path) == "unknown"  # not a repository

    def git(*args: str) -> str:
        cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
        return subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD").strip()
    assert git_sha(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("not part of the tree\n")
    assert git_sha(tmp_path) == head  # untracked files do not count
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_sha(tmp_path) == head + "+dirty"
    monkeypatch.setenv("PIPELINE_GIT_SHA", "abc1234")
    assert git_sha(tmp_path) == "abc1234"
