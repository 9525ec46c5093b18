from __future__ import annotations

import pytest

from pipeline.rewards.math_equiv import (
    compute_score,
    extract_math_answer,
    is_equiv,
    last_boxed,
    normalize_math_answer,
    reward_fn,
)


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


def test_extract_falls_back_to_the_last_number():
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
