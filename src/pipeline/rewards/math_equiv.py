r"""Equivalence of free-form math answers (MATH-style `\boxed{...}`).

Exact string match under-credits correct answers written differently (`\frac12`, `1/2`, `0.5`,
`\left(`, `5 dollars`), so both sides are normalised to one spelling, and answers that are both
plain numbers are compared as exact fractions. That fast path decides most pairs in
microseconds. Only when it finds the answers different and they are not both plain numbers
does a symbolic check run (math-verify: `2\sqrt2` == `\sqrt8`, `(x+1)^2` == `x^2+2x+1`, sets
in any order), in a worker process that is killed when the check exceeds its time limit, so
adversarial input costs at most that limit (see `symbolic`).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import os
import re
import threading
from fractions import Fraction
from typing import Any

from pipeline.errors import PipelineError

SYMBOLIC_TIMEOUT_S = 2.0

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER = re.compile(r"-?\$?(?:[0-9][0-9,]*(?:\.[0-9]*)?|\.[0-9]+)")
_UNITS = (
    "dollars?|cents?|units?|degrees?|meters?|metres?|centimeters?|millimeters?|kilometers?|"
    "inch(?:es)?|feet|foot|ft|yards?|miles?|cm|mm|km|m|hours?|minutes?|seconds?|days?|weeks?|"
    "years?|grams?|kilograms?|kg|g|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|sq|square|cubic|"
    "mph|percent"
)
_TRAILING_UNIT = re.compile(rf"(?:\s*\b(?:{_UNITS})\b(?:\^\{{?[23]\}}?)?)+\s*$")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf|operatorname)\s*\{")
_REMOVE_LITERALS = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\displaystyle",
    "^\\circ",
    "^{\\circ}",
    "\\circ",
    "°",
    "\\%",
    "%",
    "\\$",
    "$",
    "~",
)
_ESCAPED_BRACES = (("\\{", "{"), ("\\}", "}"))
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SHORT_LHS = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=(?!=)")
_SIMPLE_OPERAND = re.compile(r"^-?[^+\-*/^()\s]+$")
# `$...$` or `\(...\)` in running text; a `$` next to a space is a price, not math.
_INLINE_MATH = re.compile(
    r"(?<![\\$])(\$\$?)(?=[^\s$])((?:\\.|[^$\\])+?)(?<=\S)\1|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S
)
# Sums and products of plain numbers: the work, not the value the task asks for.
_ARITHMETIC = re.compile(r"[-+]?\(?[0-9.]+\)?(?:(?:[-+*]|\\cdot|\\times)[-+]?\(?[0-9.]+\)?)+")
_MAX_SYMBOLIC_CHARS = 1000
_SYMBOLIC_SPEC = "pipeline.rewards.symbolic:equal"
_SYMBOLIC_STARTUP_S = 60.0


class SymbolicCheckError(PipelineError):
    """The symbolic checker's worker cannot run (math-verify missing, or it crashed)."""


def _read_group(s: str, i: int) -> tuple[str, int] | None:
    """The braced group or single token starting at `s[i]` (after spaces), and where it ends."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    return s[i + 1 : j], j + 1
        return None
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+", s[i:])
        if m:
            return m.group(0), i + len(m.group(0))
    return s[i], i + 1


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` / `\fbox{...}` (nested braces allowed), or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(cmd)
    if rest < len(text) and text[rest] == " ":  # `\boxed 5`
        m = re.match(r"\s*([^\s$]+)", text[rest:])
        return m.group(1) if m else None
    group = _read_group(text, rest)
    return group[0] if group and text[rest:].lstrip().startswith("{") else None


def extract_math_answer(text: str) -> str | None:
    r"""The boxed answer if there is one, else the last `$...$` math (unless a number follows
    it in the text), else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    spans = list(_INLINE_MATH.finditer(text))
    numbers = [m for m in _NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
    if spans and (not numbers or numbers[-1].start() < spans[-1].end()):
        last = spans[-1]
        return next(g for g in last.groups()[1:] if g is not None).strip()
    return numbers[-1].group(0).rstrip(".,") if numbers else None


def _unwrap_text(s: str) -> str:
    r"""`\text{cm}` -> ` cm `, keeping the content so unit stripping can see it."""
    while True:
        m = _TEXT_WRAPPERS.search(s)
        if not m:
            return s
        group = _read_group(s, m.end() - 1)
        if group is None:
            return s[: m.start()] + s[m.end() :]
        s = s[: m.start()] + " " + group[0] + " " + s[group[1] :]


def _rewrite_command(s: str, cmd: str, nargs: int, render: Any) -> str:
    """Replace every `cmd` with `render(*args)`, reading brace groups or single tokens."""
    out: list[str] = []
    i = 0
    while True:
        j = s.find(cmd, i)
        if j < 0 or (j + len(cmd) < len(s) and s[j + len(cmd)].isalpha()):
            if j < 0:
                out.append(s[i:])
                return "".join(out)
            out.append(s[i : j + len(cmd)])
            i = j + len(cmd)
            continue
        args: list[str] = []
        k = j + len(cmd)
        for _ in range(nargs):
            group = _read_group(s, k)
            if group is None:
                break
            args.append(group[0])
            k = group[1]
        if len(args) < nargs:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        out.append(render(*[_rewrite_all(a) for a in args]))
        i = k


def _operand(x: str) -> str:
    return x if _SIMPLE_OPERAND.match(x) else f"({x})"


def _rewrite_all(s: str) -> str:
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _rewrite_command(s, "\\frac", 2, lambda a, b: f"{_operand(a)}/{_operand(b)}")
    s = _rewrite_command(s, "\\sqrt", 1, lambda a: f"\\sqrt{{{a}}}")
    return s


def normalize_math_answer(answer: str) -> str:
    """One canonical spelling for an answer string; idempotent."""
    s = answer.strip()
    s = _unwrap_text(s)
    for lit in _REMOVE_LITERALS:
        s = s.replace(lit, "")
    for old, new in _ESCAPED_BRACES:
        s = s.replace(old, new)
    s = s.replace("\\ ", " ")
    s = _TRAILING_UNIT.sub("", s).strip()
    m = _SHORT_LHS.match(s)
    if m:
        s = s[m.end() :]
    s = s.strip().rstrip(".").strip()
    if _THOUSANDS.fullmatch(s.replace(" ", "")):
        s = s.replace(",", "")
    s = _rewrite_all(s)
    s = re.sub(r"\s+", "", s)
    while s.startswith("{") and s.endswith("}") and _read_group(s, 0) == (s[1:-1], len(s)):
        s = s[1:-1]
    s = re.sub(r"(?<![0-9])\.(?=[0-9])", "0.", s)
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)
    return choice.group(1) if choice else s


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of `s` if it is a number or nested quotients of numbers, else None.

    Only division and negation are evaluated: `1+1` is not credited as `2`, because the task
    asked for a simplified answer.
    """
    if len(s) > 64 or not re.fullmatch(r"[-0-9./()]+", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        pass
    try:
        tree = ast.parse(s, mode="eval").body
        return _eval_quotient(tree)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _eval_quotient(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_quotient(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _eval_quotient(node.left) / _eval_quotient(node.right)
    raise ValueError("not a quotient of numbers")


def is_equiv(
    answer: str | None, reference: str | None, symbolic_timeout_s: float = SYMBOLIC_TIMEOUT_S
) -> bool:
    """Whether two answer strings mean the same thing.

    Normalised strings and exact numbers first; then, unless `symbolic_timeout_s` is 0, the
    symbolic check, which counts as "not equal" when it takes longer than that.
    """
    if answer is None or reference is None:
        return False
    a, b = normalize_math_answer(answer), normalize_math_answer(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    if _is_arithmetic_for_a_number(a, fb) or _is_arithmetic_for_a_number(b, fa):
        return False
    if symbolic_timeout_s <= 0 or max(len(answer), len(reference)) > _MAX_SYMBOLIC_CHARS:
        return False
    return _CHECKER.equal(answer.strip(), reference.strip(), symbolic_timeout_s)


def _is_arithmetic_for_a_number(side: str, other: Fraction | None) -> bool:
    return other is not None and _ARITHMETIC.fullmatch(side) is not None


class _SymbolicChecker:
    """`symbolic.equal` in one reward worker process, started on first use.

    A check that runs past its limit is abandoned by killing the worker by pid (the scorer's
    worker, whose restart does not count against any check); a hung sympy call cannot be
    interrupted any other way.
    """

    def __init__(self, spec: str = _SYMBOLIC_SPEC) -> None:
        self._spec = spec
        self._lock = threading.Lock()
        self._worker: Any = None
        self._owner_pid = 0

    def equal(self, answer: str, reference: str, timeout_s: float) -> bool:
        from pipeline.rewards.scorer import _Worker, _WorkerLost, _WorkerTimeout
        from pipeline.rewards.types import ScoreItem

        with self._lock:
            if self._worker is None or self._owner_pid != os.getpid():  # none, or forked
                self._worker = _Worker([self._spec], _SYMBOLIC_STARTUP_S)
                self._owner_pid = os.getpid()
            worker = self._worker
            try:
                load_errors = worker.hello().load_errors
            except _WorkerLost as exc:
                self._drop()
                raise SymbolicCheckError(f"the symbolic math checker did not start: {exc}") from exc
            if load_errors:
                self._drop()
                raise SymbolicCheckError(
                    f"the symbolic math checker cannot load: {load_errors[self._spec]}; "
                    "install the project's dependencies (`pip install -e .` brings math-verify)"
                )
            item = ScoreItem("symbolic", "math", answer, reference)
            try:
                reply = worker.call(item, self._spec, timeout_s)
            except _WorkerTimeout:
                self._restart(worker)
                _logger().warning(
                    "symbolic math check timed out; counted as not equal",
                    timeout_s=timeout_s,
                    answer=answer[:80],
                    reference=reference[:80],
                )
                return False
            except _WorkerLost as exc:
                self._restart(worker)
                raise SymbolicCheckError(f"the symbolic math checker died: {exc}") from exc
        # An exception inside math-verify means it could not read an answer: not equal.
        return reply.error is None and reply.score == 1.0

    def _restart(self, worker: Any) -> None:
        worker.kill()
        with contextlib.suppress(OSError):  # the next call retries the start
            worker.start()

    def _drop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        """Kill the worker by pid; safe to call more than once, and a no-op in a forked child."""
        with self._lock:
            if self._owner_pid == os.getpid():
                self._drop()


def _logger() -> Any:
    from pipeline.log import get_logger

    return get_logger("rewards.math")


_CHECKER = _SymbolicChecker()
atexit.register(_CHECKER.close)


def compute_score(
    solution_str: str,
    ground_truth: str,
    score: float = 1.0,
    symbolic_timeout_s: float = SYMBOLIC_TIMEOUT_S,
) -> float:
    r"""`score` when the solution's final answer equals the ground truth, else 0.

    The ground truth may itself be a worked solution containing `\boxed{...}`.
    """
    reference = last_boxed(ground_truth)
    reference = ground_truth if reference is None else reference
    answer = extract_math_answer(solution_str)
    return score if is_equiv(answer, reference, symbolic_timeout_s) else 0.0


def reward_fn(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """Registry entry; `extra_info` may set `score` and `symbolic_timeout_s` (0: no symbolic)."""
    info = extra_info or {}
    return compute_score(
        solution_str,
        str(ground_truth),
        float(info.get("score", 1.0)),
        float(info.get("symbolic_timeout_s", SYMBOLIC_TIMEOUT_S)),
    )
