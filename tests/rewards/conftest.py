"""Shared fixtures: the real GSM8K test split, which lives outside the repo in `shared/`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_TEST = REPO_ROOT / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
USER_REWARDS = Path(__file__).resolve().parent / "user_rewards.py"


@pytest.fixture(scope="session")
def gsm8k_test_rows() -> list[dict[str, str]]:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"real GSM8K test split not found at {GSM8K_TEST.resolve()}")
    with GSM8K_TEST.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="session")
def user_rewards() -> Path:
    """A file of user reward functions (good, raising, hanging, crashing) for the scorer."""
    return USER_REWARDS


@pytest.fixture(scope="session", autouse=True)
def stop_symbolic_checker():
    """The math verifier's symbolic check starts a worker process on first use; end it by pid."""
    yield
    from pipeline.rewards import math_equiv

    math_equiv._CHECKER.close()
