r"""Symbolic equivalence of two math answers with math-verify (sympy + latex2sympy2).

Loaded only inside a reward worker process (`math_equiv` starts it): sympy can spin for
seconds or forever on adversarial input (`2^{2^{2^{2^{10}}}}`), and only a process can be
stopped mid-computation, so the caller bounds each check by killing the worker by pid.
math-verify's own signal-based timeouts are off for the same reason (they only work in a
main thread and cannot interrupt sympy's C-level big-integer work).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# The "timeout is disabled" warning is about the bound this module's caller provides.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _parse(answer: str) -> list[Any]:
    text = answer if _UNESCAPED_DOLLAR.search(answer) else f"${answer}$"
    return parse(text, list(_EXTRACTION), parsing_timeout=None)


def equal(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """1.0 when the answer `solution_str` equals the reference `ground_truth`, else 0.0.

    Both are answer strings (already extracted), not whole solutions; the registry's reward
    signature lets the existing worker process serve this function.
    """
    reference = _parse(ground_truth)
    answer = _parse(solution_str)
    return float(bool(reference and answer) and verify(reference, answer, timeout_seconds=None))


# The first parse builds the LaTeX grammar (slow); do it at load, outside any sample's limit.
_parse("1")
