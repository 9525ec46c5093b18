"""Shared fixtures: a saved char tokenizer and the real GSM8K test split (outside the repo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_TEST = REPO_ROOT / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory) -> Path:
    return save_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))


@pytest.fixture(scope="session")
def char_tokenizer(char_tokenizer_dir):
    """Loaded once: importing transformers costs seconds on a small CPU."""
    return load_tokenizer(char_tokenizer_dir)


@pytest.fixture(scope="session")
def gsm8k_test_rows() -> list[dict[str, str]]:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"real GSM8K test split not found at {GSM8K_TEST.resolve()}")
    with GSM8K_TEST.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
