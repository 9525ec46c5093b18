"""A jsonl dataset of toy reversal rows, each with its own response budget or none, and
ignoring end-of-sequence or not."""

from __future__ import annotations

import json
from pathlib import Path


def budget_rows(path: Path, budgets: list[object], *, ignore_eos: object = None) -> Path:
    """Row i reverses the digits of 100 + i; `budgets[i]` is its `max_new_tokens` (None:
    the row carries none); `ignore_eos`, when given, every row's `ignore_eos` (a list: row
    i's, None for none)."""
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
            flag = ignore_eos[i] if isinstance(ignore_eos, list) else ignore_eos
            if flag is not None:
                row["ignore_eos"] = flag
            out.write(json.dumps(row) + "\n")
    return path
