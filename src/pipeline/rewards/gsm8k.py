"""GSM8K answer checking, scored the way lm-eval and verl score it.

"strict" only credits an answer written in the dataset's own `#### N` format, which is what the
prompt asks for; "flexible" credits the last number anywhere, which measures arithmetic without
the format. Both normalise the number, because these differences are presentation, not a wrong
answer: `$`, markdown emphasis, extra spaces after `####`, Unicode minus and other dashes,
a space between sign and number, thousands separators in 3-digit groups (`1,000`, `1 000`, thin
spaces), `18.00` == `18`, fractions (`3/4` == `0.75`), scientific notation (`1e3`), a trailing
unit or period.

Strict refuses what a grader could not read as one number: commas that are not thousands
separators (`1,2,3` is not 123) and several numbers after the marker (`17 18`, `17, 18`,
`17 or 18`) score 0. Words after the number are commentary (`18 dollars, 3 more than before`).
When there are several markers the last one with a number after it counts, so markdown
headings (`#### Step 1`) are skipped.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

Method = Literal["strict", "flexible"]

# Minus signs and dashes models write for "-", and spaces used to group digits.
_UNICODE = str.maketrans(
    dict.fromkeys("\u2212\u2010\u2011\u2012\u2013\u2014\u2015\ufe58\ufe63\uff0d", "-")
    | dict.fromkeys("\u00a0\u2007\u2009\u200a\u202f", " ")
)
_MARKER = re.compile(r"#{4,}")
_LEAD = re.compile(r"[ \t*_`]*(?:\\boxed\{)?[ \t*_`]*")
_CLOSE = re.compile(r"[*_`}]*(?:\\?\$)?")
_NUMBER = re.compile(
    r"""
    (?P<sign>[-+]?)[ \t]*(?:\\?\$[ \t]*)?(?P<sign2>[-+]?)[ \t]*
    (?:
        \\[dt]?frac\{(?P<fnum>\d+)\}\{(?P<fden>\d+)\}
      | (?P<whole>\d+)[ ](?P<mnum>\d+)/(?P<mden>\d+)
      | (?P<mantissa>
            (?:\d{1,3}(?:,\d{3})+|\d{1,3}(?:[ ]\d{3})+)(?!\d)(?:\.\d+)?
          | \d+(?:\.\d*)?
          | \.\d+
        )
        (?:[eE](?P<exp>[-+]?\d{1,3}))?
        (?:[ \t]*/[ \t]*(?P<den>\d+))?
    )
    """,
    re.VERBOSE,
)
# `1,2,3`, `1.2.3`, `1,0000`: a separator in the wrong place, so the value is unknowable.
_MALFORMED = re.compile(r"\d|[.,]\d")
_ANOTHER_NUMBER = re.compile(
    r"[ \t]*(?:[-+*/^x\u00d7=,;&]|and\b|or\b|to\b|vs\b)?[ \t]*[-+]?[ \t]*(?:\\?\$)?\d"
)
# Flexible mode's number token; a sign only when it does not follow a digit (`10-5` is 5).
_TOKEN = re.compile(
    r"(?<![\d/])(?=[-$.\d])-?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"(?:[eE][-+]?\d{1,3}(?!\w))?(?:/\d+(?![/\d]))?|\.\d+)"
)
_MAX_NUMBER_CHARS = 100  # no real answer is longer; bounds the big-integer work
_MAX_LINE_CHARS = 200  # of an answer line, only its start decides


def _unify(text: str) -> str:
    return text if text.isascii() else text.translate(_UNICODE)


def _parse_number(text: str) -> tuple[int, int] | None:
    """(numerator, denominator) of the one number `text` starts with; None for none or several."""
    s = _skip(_LEAD, _unify(text))
    m = _NUMBER.match(s)
    if m is None or (m["sign"] and m["sign2"]) or m.end() > _MAX_NUMBER_CHARS:
        return None
    rest = _skip(_CLOSE, s[m.end() :])
    if _MALFORMED.match(rest) or _ANOTHER_NUMBER.match(rest):
        return None
    if m["fnum"] is not None:
        num, den = int(m["fnum"]), int(m["fden"])
    elif m["whole"] is not None:
        part, den = int(m["mnum"]), int(m["mden"])
        if not 0 < part < den:  # `3 5/2` is not a mixed number
            return None
        num = int(m["whole"]) * den + part
    else:
        whole, _, decimals = m["mantissa"].replace(",", "").replace(" ", "").partition(".")
        num, den = int(whole + decimals or "0"), 10 ** len(decimals)
        exp = int(m["exp"] or 0)
        num, den = (num * 10**exp, den) if exp >= 0 else (num, den * 10**-exp)
        den *= int(m["den"] or 1)
    if den == 0:
        return None
    return (-num if "-" in (m["sign"], m["sign2"]) else num), den


def _skip(pattern: re.Pattern[str], s: str) -> str:
    m = pattern.match(s)
    return s[m.end() :] if m else s


def _canonical(num: int, den: int) -> str:
    """`18.5`, `0.125`, `1000`, or `1/3` when the decimal does not terminate."""
    common = math.gcd(num, den)
    num, den = num // common, den // common
    if den == 1:
        return str(num)
    rest, twos, fives = den, 0, 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{num}/{den}"
    places = max(twos, fives)
    digits = str(abs(num) * 10**places // den).rjust(places + 1, "0")
    body = f"{digits[:-places]}.{digits[-places:]}"
    return f"-{body}" if num < 0 else body


def normalize_number(text: str) -> str | None:
    """Canonical text of a number, so equal values compare equal as strings.

    Returns None when nothing numeric is left (e.g. `####  .`) or the number is ambiguous
    (`1,2,3`), which then scores as "no answer".
    """
    value = _parse_number(text)
    return None if value is None else _canonical(*value)


def _strict_answer(text: str) -> str | None:
    for marker in reversed(list(_MARKER.finditer(text))):
        end = text.find("\n", marker.end())
        line = text[marker.end() : end if end >= 0 else len(text)][:_MAX_LINE_CHARS]
        if _NUMBER.match(_skip(_LEAD, _unify(line))):
            return normalize_number(line)
    return None


def extract_answer(text: str, method: Method = "strict") -> str | None:
    """The normalised final answer in `text`, or None when there is none."""
    if method == "strict":
        return _strict_answer(text)
    if method == "flexible":
        for token in reversed(_TOKEN.findall(_unify(text))):
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
