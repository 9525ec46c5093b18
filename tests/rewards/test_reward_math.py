from __future__ import annotations

import os
import time

import pytest

from pipeline.rewards import math_equiv
from pipeline.rewards.math_equiv import (
    SymbolicCheckError,
    _SymbolicChecker,
    compute_score,
    extract_math_answer,
    is_equiv,
    last_boxed,
    normalize_math_answer,
    reward_fn,
)
from pipeline.rewards.scorer import RewardScorer
from pipeline.rewards.types import ScoreItem

# sympy evaluates this tower of powers for as long as it is allowed to
TOWER = r"2^{2^{2^{2^{2^{10}}}}}"


def _worker_pid(checker: _SymbolicChecker) -> int | None:
    """The checker's worker pid, None before first use; it changes when a worker is replaced."""
    worker = checker._worker
    return None if worker is None else worker.pid


def symbolic_checker_pid() -> int | None:
    """Pid of the shared symbolic checker's worker process, None while none runs."""
    return _worker_pid(math_equiv._CHECKER)


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        (r"\frac{1}{2}", "1/2"),
        (r"\frac12", "0.5"),
        (r"\dfrac{3}{4}", ".75"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"-\frac{1}{2}", "-0.5"),
        (r"\frac{\frac{1}{2}}{3}", r"\frac{1}{6}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"5 \text{ dollars}", "5"),
        ("12 cm^2", "12"),
        (r"10\%", "10"),
        (r"90^\circ", "90"),
        (r"\!5", "5"),
        ("x = 5", "5"),
        ("1,000", "1000"),
        ("18.00", "18"),
        (r"\frac{x+1}{2}", "(x+1)/2"),
        (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"),
        (r"2\sqrt{2}", r"2\sqrt2"),
        (r"\text{(B)}", "B"),
        (r"\{1,2\}", "{1, 2}"),
        (r"\$42", "42"),
    ],
)
def test_equivalent(answer, reference):
    assert is_equiv(answer, reference)
    assert is_equiv(reference, answer)


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("3", "4"),
        (r"\frac{1}{3}", "0.33"),
        ("1+1", "2"),
        ("1/0", "0"),
        ("(1,2)", "(2,1)"),
        ("x", "y"),
        ("", "0"),
        (None, "1"),
    ],
)
def test_not_equivalent(answer, reference):
    assert not is_equiv(answer, reference)


def test_boxed_extraction_handles_nested_braces_and_takes_the_last():
    text = r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}} done"
    assert last_boxed(text) == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"so \boxed 5$") == "5"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("no box") is None


def test_extract_falls_back_to_inline_math_then_the_last_number():
    assert extract_math_answer(r"So the answer is $\frac34$.") == r"\frac34"
    assert extract_math_answer(r"Hence $$x^2$$") == "x^2"
    assert extract_math_answer(r"Hence \(x+1\).") == "x+1"
    assert extract_math_answer("With $x$ known we get 5 apples.") == "5"
    assert extract_math_answer("It costs $5 and $6 in total.") == "$6"
    assert extract_math_answer("The answer is 12.") == "12"
    assert extract_math_answer("nothing numeric") is None
    assert extract_math_answer(r"2 and 3, so \boxed{x^2}") == "x^2"


def test_normalize_is_idempotent():
    for s in [r"\left(\frac{1}{2}, 3\right)", r"5\text{ dollars}", r"\frac{\frac{1}{2}}{3}"]:
        once = normalize_math_answer(s)
        assert normalize_math_answer(once) == once


def test_compute_score_with_boxed_reference_solution():
    reference = r"We compute carefully and get $\boxed{\dfrac{1}{2}}$."
    assert compute_score(r"Thus \boxed{0.5}.", reference) == 1.0
    assert compute_score(r"Thus \boxed{0.6}.", reference) == 0.0
    assert compute_score("no answer here", "1/2") == 0.0
    assert reward_fn("math", r"\boxed{1/2}", r"\frac12", {"score": 2.0}) == 2.0


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        (r"2\sqrt2", r"\sqrt8"),
        ("2x+1", "1+2x"),
        (r"\{1,2\}", r"\{2,1\}"),
        ("x^2+2x+1", "(x+1)^2"),
        ("10^{3}", "1000"),
    ],
)
def test_symbolic_equivalence_and_switching_it_off(answer, reference):
    assert is_equiv(answer, reference)
    assert is_equiv(reference, answer)
    assert not is_equiv(answer, reference, symbolic_timeout_s=0)
    assert reward_fn("math", rf"\boxed{{{answer}}}", reference, {"symbolic_timeout_s": 0}) == 0.0


def test_plain_numbers_never_reach_the_symbolic_check():
    checker_pid = symbolic_checker_pid()
    assert not is_equiv(r"\frac{1}{3}", "0.33")
    assert not is_equiv(r"2\cdot 3", "6")
    assert symbolic_checker_pid() == checker_pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hanging_symbolic_check_is_cut_off_at_its_limit():
    assert is_equiv("2x", "x+x")  # the worker is up
    old_pid = symbolic_checker_pid()
    start = time.monotonic()
    assert not is_equiv(TOWER, "3", symbolic_timeout_s=0.5)
    assert time.monotonic() - start < 0.5 + 1.0
    assert old_pid is not None and not _alive(old_pid)
    assert symbolic_checker_pid() not in (None, old_pid)
    assert is_equiv(r"2\sqrt2", r"\sqrt8")  # the replacement answers


def test_the_scorer_scores_an_adversarial_math_sample_within_the_limit():
    with RewardScorer("math") as scorer:
        start = time.monotonic()
        results = scorer.score_batch_sync(
            [
                ScoreItem("tower", "math", rf"\boxed{{{TOWER}}}", "3", {"symbolic_timeout_s": 0.5}),
                ScoreItem("ok", "math", r"\boxed{2\sqrt2}", r"\sqrt8"),
            ]
        )
        elapsed = time.monotonic() - start
    assert [(r.status, r.score) for r in results] == [("ok", 0.0), ("ok", 1.0)]
    assert elapsed < 0.5 + 5.0  # the limit plus one worker restart


def test_a_missing_symbolic_library_is_a_typed_error():
    checker = _SymbolicChecker("no_such_pkg_xyz.symbolic:equal")
    try:
        with pytest.raises(SymbolicCheckError, match="pip install -e"):
            checker.equal("x", "y", 1.0)
        assert _worker_pid(checker) is None
    finally:
        checker.close()
