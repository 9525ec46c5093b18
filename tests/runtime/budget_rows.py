"""A jsonl dataset of toy reversal rows, each with its own response budget or none."""

from __future__ import annotations

import json
from pathlib import Path


def budget_rows(path: Path, budgets: list[object]) -> Path:
    """Row i reverses the digits of 100 + i; `budgets[i]` is its `max_new_tokens` (None:
    the row carries none)."""
    with path.open("w") as out:
        for i, budget in enumerate(budgets):
            digits = f"{100 + i}"
            row = {
                "uid": f"r{i}",
                "prompt": f"reverse {digits} =",
                "data_source": "toy_reverse",
                "reward_model": {"ground_truth": digits[::-1]},
            }
            if budget is not None:
                row["max_new_tokens"] = budget
            out.write(json.dumps(row) + "\n")
    return path
