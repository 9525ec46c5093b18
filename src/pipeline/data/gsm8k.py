"""GSM8K rows (`question`, `answer`) in the RL schema.

The conversion matches verl's gsm8k preprocessing (same instruction, data_source and
ground truth), so datasets prepared either way score the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pipeline.data.records import BadRowError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def answer_number(answer: str) -> str:
    """The final number of a GSM8K worked answer (`... #### 1,234` -> `1234`)."""
    marker = answer.rfind("####")
    if marker < 0:
        raise ValueError("GSM8K answer has no '####' final-answer marker")
    number = answer[marker + 4 :].strip().replace(",", "")
    if not number:
        raise ValueError("GSM8K answer has nothing after '####'")
    return number


def gsm8k_to_rl(
    row: Mapping[str, Any], index: int, split: str, *, path: str = "<gsm8k>"
) -> dict[str, Any]:
    """One GSM8K row as an RL-schema row with a chat prompt."""
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        raise BadRowError(path, index, "GSM8K rows need string 'question' and 'answer' fields")
    try:
        truth = answer_number(answer)
    except ValueError as exc:
        raise BadRowError(path, index, str(exc)) from exc
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_gsm8k(rows: Iterable[Mapping[str, Any]], split: str) -> list[dict[str, Any]]:
    """All rows converted, indexed in order."""
    return [gsm8k_to_rl(row, i, split) for i, row in enumerate(rows)]
