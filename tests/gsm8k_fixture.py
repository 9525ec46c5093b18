"""A self-made GSM8K-format fixture: 32 grade-school problems generated with their
arithmetic computed rather than typed, so tests and smoke runs need no download."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from pipeline.data.formats import write_rows
from pipeline.data.gsm8k import convert_gsm8k


class _Worked(msgspec.Struct):
    """A worked solution: its explanation lines and the final number."""

    lines: list[str]
    result: int


def _calc(expr: str) -> tuple[str, int]:
    """`a op b` rendered GSM8K-style with its calculator annotation, and its value."""
    value = _evaluate(expr)
    return f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}", value


def _evaluate(expr: str) -> int:
    tokens = expr.split()
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        b = int(operand)
        if op == "+":
            value += b
        elif op == "-":
            value -= b
        elif op == "*":
            value *= b
        elif op == "/":
            if value % b:
                raise ValueError(f"{expr} is not a whole number")
            value //= b
        else:
            raise ValueError(f"unknown operator {op!r}")
    return value


def _eggs(name: str, laid: int, used: int, price: int) -> tuple[str, _Worked]:
    q = (
        f"{name}'s hens lay {laid} eggs per day. {name} uses {used} of them for baking and sells "
        f"the rest for ${price} each. How many dollars does {name} earn per day?"
    )
    step1, left = _calc(f"{laid} - {used}")
    step2, money = _calc(f"{left} * {price}")
    return q, _Worked([f"{name} sells {step1} eggs.", f"{name} earns {step2} dollars."], money)


def _pages(name: str, a: int, d: int, b: int, e: int) -> tuple[str, _Worked]:
    q = (
        f"{name} reads {a} pages a day for {d} days, then {b} pages a day for {e} days. "
        "How many pages does she read in total?"
    )
    s1, first = _calc(f"{a} * {d}")
    s2, second = _calc(f"{b} * {e}")
    s3, total = _calc(f"{first} + {second}")
    return q, _Worked([f"First she reads {s1} pages.", f"Then {s2} pages.", f"In all {s3}."], total)


def _bus(passengers: int, off: int, on: int, _unused: int = 0) -> tuple[str, _Worked]:
    q = (
        f"A bus leaves with {passengers} passengers. At the first stop {off} get off and {on} get "
        "on. At the second stop half of the passengers get off. How many passengers are left?"
    )
    s1, after = _calc(f"{passengers} - {off} + {on}")
    s2, left = _calc(f"{after} / 2")
    return q, _Worked([f"After the first stop there are {s1}.", f"Then {s2} remain."], left)


def _savings(name: str, weekly: int, weeks: int, spent: int) -> tuple[str, _Worked]:
    q = (
        f"{name} saves ${weekly} every week for {weeks} weeks and then spends ${spent} on a "
        "bike. How many dollars does he have left?"
    )
    s1, saved = _calc(f"{weekly} * {weeks}")
    s2, left = _calc(f"{saved} - {spent}")
    return q, _Worked([f"He saves {s1} dollars.", f"He has {s2} dollars left."], left)


def _crates(per_crate: int, crates: int, sold: int, _unused: int = 0) -> tuple[str, _Worked]:
    q = (
        f"A crate holds {per_crate} apples. A store buys {crates} crates and sells {sold} apples. "
        "How many apples does the store have left?"
    )
    s1, total = _calc(f"{per_crate} * {crates}")
    s2, left = _calc(f"{total} - {sold}")
    return q, _Worked([f"The store buys {s1} apples.", f"It has {s2} apples left."], left)


def _fence(length: int, width: int, price: int, _unused: int = 0) -> tuple[str, _Worked]:
    q = (
        f"A garden is {length} feet long and {width} feet wide. Fencing costs ${price} per foot. "
        "How many dollars does it cost to fence the whole garden?"
    )
    s1, half = _calc(f"{length} + {width}")
    s2, perimeter = _calc(f"{half} * 2")
    s3, cost = _calc(f"{perimeter} * {price}")
    lines = [f"Half the perimeter is {s1} feet.", f"The perimeter is {s2} feet."]
    return q, _Worked([*lines, f"The fence costs {s3} dollars."], cost)


def _temperature(noon: int, drop: int, _a: int = 0, _b: int = 0) -> tuple[str, _Worked]:
    q = (
        f"The temperature was {noon} degrees at noon and dropped by {drop} degrees by midnight. "
        "What was the temperature at midnight, in degrees?"
    )
    s1, value = _calc(f"{noon} - {drop}")
    return q, _Worked([f"At midnight it was {s1} degrees."], value)


def _cookies(name: str, batches: int, per_batch: int, friends: int) -> tuple[str, _Worked]:
    q = (
        f"{name} bakes {batches} batches of {per_batch} cookies and gives 3 cookies to each of "
        f"her {friends} friends. How many cookies does she have left?"
    )
    s1, baked = _calc(f"{batches} * {per_batch}")
    s2, given = _calc(f"3 * {friends}")
    s3, left = _calc(f"{baked} - {given}")
    return q, _Worked(
        [f"She bakes {s1} cookies.", f"She gives away {s2}.", f"{s3} are left."], left
    )


_FIXTURE: list[tuple[Callable[..., tuple[str, _Worked]], tuple[Any, ...]]] = [
    (_eggs, ("Mia", 16, 3, 2)),
    (_eggs, ("Ana", 12, 5, 3)),
    (_eggs, ("Leo", 20, 8, 4)),
    (_eggs, ("Sam", 9, 1, 5)),
    (_pages, ("Ivy", 12, 5, 20, 3)),
    (_pages, ("Zoe", 30, 4, 25, 6)),
    (_pages, ("Eva", 8, 7, 10, 2)),
    (_pages, ("Amy", 45, 10, 60, 12)),
    (_bus, (40, 6, 10)),
    (_bus, (25, 5, 8)),
    (_bus, (50, 12, 4)),
    (_bus, (18, 2, 0)),
    (_savings, ("Tom", 25, 8, 120)),
    (_savings, ("Ben", 150, 12, 600)),
    (_savings, ("Max", 40, 52, 300)),
    (_savings, ("Jon", 15, 10, 90)),
    (_crates, (24, 5, 37)),
    (_crates, (48, 30, 215)),
    (_crates, (12, 9, 100)),
    (_crates, (36, 50, 1)),
    (_fence, (12, 8, 5)),
    (_fence, (30, 20, 15)),
    (_fence, (7, 3, 9)),
    (_fence, (100, 60, 4)),
    (_temperature, (12, 5)),
    (_temperature, (4, 14)),
    (_temperature, (0, 3)),
    (_temperature, (21, 21)),
    (_cookies, ("Lea", 3, 12, 4)),
    (_cookies, ("Kim", 5, 24, 10)),
    (_cookies, ("Uma", 2, 18, 7)),
    (_cookies, ("Ada", 40, 36, 20)),
]


def gsm8k_fixture_rows() -> list[dict[str, str]]:
    """32 made-up grade-school problems in GSM8K's own format (`... #### N`)."""
    rows = []
    for make, args in _FIXTURE:
        question, worked = make(*args)
        final = f"{worked.result:,}"  # GSM8K writes thousands separators in some answers
        rows.append({"question": question, "answer": "\n".join([*worked.lines, f"#### {final}"])})
    return rows


class GSM8KFixturePaths(msgspec.Struct, frozen=True):
    """Where `write_gsm8k_fixture` put each of its four files."""

    raw_jsonl: Path
    raw_parquet: Path
    rl_jsonl: Path
    rl_parquet: Path


def write_gsm8k_fixture(out_dir: str | Path) -> GSM8KFixturePaths:
    """Write the fixture raw (GSM8K columns) and converted (RL schema), as JSONL and parquet."""
    out = Path(out_dir)
    raw = gsm8k_fixture_rows()
    rl = convert_gsm8k(raw, split="fixture")
    return GSM8KFixturePaths(
        raw_jsonl=write_rows(raw, out / "gsm8k_fixture.jsonl"),
        raw_parquet=write_rows(raw, out / "gsm8k_fixture.parquet"),
        rl_jsonl=write_rows(rl, out / "gsm8k_fixture_rl.jsonl"),
        rl_parquet=write_rows(rl, out / "gsm8k_fixture_rl.parquet"),
    )
