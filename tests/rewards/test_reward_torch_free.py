"""Rewards and data run in light services (reward workers start per timeout); no torch there."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "pipeline.rewards.scorer",
    "pipeline.rewards.gsm8k",
    "pipeline.rewards.math_equiv",
    "pipeline.rewards.symbolic",
    "pipeline.rewards.format",
    "pipeline.data.loader",
    "pipeline.data.cursor",
    "pipeline.data.gsm8k",
    "pipeline.data.toy_task",
    "pipeline.data.tokenizer",
]


def test_rewards_and_data_do_not_import_torch_or_transformers():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in MODULES)
        + "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        + "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
