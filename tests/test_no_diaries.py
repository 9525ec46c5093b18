"""Comments and docstrings in src/ say why, not what a run measured: no GPU model named as
the place of a measurement and no timing figures (those belong in docs/performance.md,
where they keep their date and setup)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

GPU = re.compile(
    r"\b(?:[ABH]100|[BH]200|H20|A10G?|A30|A40|L4|L40S?|V100|T4|GH200|GB200|MI[23]\d0X?"
    r"|Hopper|Blackwell|Ampere|Ada Lovelace)\b"
)
# a number with a unit of time or a rate; a bare "s" or "seconds" only when approximate
# ("~0.3 s"), so "2 s, doubling to 30 s" (a backoff) or "timeout in seconds" pass
# a number on its own, not the digits of a name ("bf16", "fp8")
NUMBER = r"(?<![\w.])\d[\d.,]*"
TIMING = re.compile(
    rf"{NUMBER}\s*(?:ms|µs|us|ns)\b"
    rf"|{NUMBER}\s*(?:s|sec|seconds?)\s*(?:/\s*\w|per\b|a step\b)"
    rf"|~\s*{NUMBER}\s*(?:s|sec|seconds?)\b"
    rf"|{NUMBER}\s*[kMGT]B/s\b"
    rf"|{NUMBER}\s*[GTP]?FLOP/?s\b"
    rf"|{NUMBER}x\s+(?:faster|slower)\b"
)
BOUND = re.compile(r"\s+(?:at most|at least)\b")


def _texts(path: Path):
    """(line, text) of each comment block (comments on consecutive lines) and docstring of
    one file."""
    source = path.read_text()
    block: list[str] = []
    first = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and tok.start[0] != last + 1:
            yield first, " ".join(block)
            block = []
        if not block:
            first = tok.start[0]
        block.append(tok.string.lstrip("#"))
        last = tok.start[0]
    if block:
        yield first, " ".join(block)
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def _matches(text: str) -> list[str]:
    flat = " ".join(text.split())
    found = []
    for pattern in (GPU, TIMING):
        for match in pattern.finditer(flat):
            if not BOUND.match(flat, match.end()):  # "25 ms at most": a limit, not a figure
                found.append(match.group(0))
    return found


def _findings(path: Path) -> list[str]:
    rel = path.relative_to(SRC.parent)
    found = []
    for line, text in _texts(path):
        for match in _matches(text):
            found.append(f"{rel}:{line}: {match!r} in {' '.join(text.split())[:100]!r}")
    return found


def test_patterns():
    assert GPU.search("measured on an H200 host")
    assert GPU.search("the Hopper profile")
    assert TIMING.search("took ~0.3 ms")
    assert TIMING.search("1-3 us each")
    assert TIMING.search("57.9 vs 58.0\nms")
    assert TIMING.search("~0.3 s of the start")
    assert TIMING.search("2.1 s/step")
    assert TIMING.search("3 seconds per sample")
    assert TIMING.search("at ~2.5 instead of 4.4 TB/s")
    assert not TIMING.search("timeout in seconds")
    assert not TIMING.search("2 s, doubling to 30 s")
    assert not _matches("waits (25 ms at most)")
    assert not TIMING.search("a 0.5B model, 8 warps, 256 rows")
    assert not GPU.search("GPU memory in GiB, a 7B model  # noqa: B027")
    assert not TIMING.search("peak FLOP/s of one device")
    assert not TIMING.search("peak dense bf16 FLOP/s of one device")
    assert TIMING.search("989 TFLOP/s dense")


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_measurement_diaries_in_comments(path: Path):
    found = _findings(path)
    assert not found, "\n".join(found)
