"""GSM8K answer checking, scored the way lm-eval and verl score it.

"strict" only credits an answer written in the dataset's own `#### N` format, which is what the
prompt asks for; "flexible" credits the last number anywhere, which measures arithmetic without
the format. Both normalise the number (commas, `$`, trailing `.`, `18.00` == `18`) because those
differences are presentation, not a wrong answer.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

Method = Literal["strict", "flexible"]

# lm-eval "strict-match" / verl gsm8k; an optional `$` after the marker is also accepted.
_STRICT = re.compile(r"#### \$?(\-?[0-9\.\,]+)")
# A number token: optional sign and `$`, digits with thousands commas, optional decimals.
_NUMBER = re.compile(r"-?\$?(?:[0-9][0-9,]*(?:\.[0-9]*)?|\.[0-9]+)")


def normalize_number(text: str) -> str | None:
    """Canonical text of a number, so equal values compare equal as strings.

    Returns None when nothing numeric is left (e.g. `####  .`), which then scores as "no answer".
    """
    s = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not s or s in {"-", "+"}:
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == 0:
        return "0"
    canon = format(value.normalize(), "f")
    return canon


def extract_answer(text: str, method: Method = "strict") -> str | None:
    """The normalised final answer in `text`, or None when there is none."""
    if method == "strict":
        found = _STRICT.findall(text)
        return normalize_number(found[-1]) if found else None
    if method == "flexible":
        for token in reversed(_NUMBER.findall(text)):
            value = normalize_number(token)
            if value is not None:
                return value
        return None
    raise ValueError(f"unknown GSM8K extraction method {method!r}; use 'strict' or 'flexible'")


def ground_truth_number(ground_truth: str) -> str | None:
    """Accept either the bare number or a full GSM8K worked answer ending in `#### N`."""
    if "####" in ground_truth:
        return extract_answer(ground_truth, "strict")
    return normalize_number(ground_truth)


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` for the right number, `format_score` for a wrong one, 0 when no answer is found."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    expected = ground_truth_number(str(ground_truth))
    return score if expected is not None and answer == expected else format_score


def reward_fn(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """Registry entry; `extra_info` may set `method`, `format_score` and `score`."""
    info = extra_info or {}
    return compute_score(
        solution_str,
        ground_truth,
        method=info.get("method", "strict"),
        format_score=float(info.get("format_score", 0.0)),
        score=float(info.get("score", 1.0)),
    )
