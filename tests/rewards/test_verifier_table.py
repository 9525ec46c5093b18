r"""Verifier scores against a human grader's, case by case (1.0 correct, 0.0 wrong).

The GSM8K rows include the strings the strict verifier used to misjudge (`####  42`, `**18**`,
Unicode minus, `- 5`, `1/2`, `3/4`, `1e3`, `1 000`, `1,2,3`); the math rows the pairs that
only a symbolic check gets right (`2\sqrt2` vs `\sqrt8`, `(x+1)^2` expanded, sets in another
order, an unboxed `$\frac34$`).
"""

from __future__ import annotations

import pytest

from pipeline.rewards import gsm8k, math_equiv

# (solution, ground truth, method, human score)
GSM8K_CASES = [
    ("#### 42", "42", "strict", 1.0),
    ("####  42", "42", "strict", 1.0),
    ("####42", "42", "strict", 1.0),
    ("#### **18**", "18", "strict", 1.0),
    ("#### *18*", "18", "strict", 1.0),
    ("#### __18__", "18", "strict", 1.0),
    ("#### `18`", "18", "strict", 1.0),
    ("#### \u22125", "-5", "strict", 1.0),
    ("#### \u20135", "-5", "strict", 1.0),
    ("#### - 5", "-5", "strict", 1.0),
    ("#### -$5", "-5", "strict", 1.0),
    ("#### +7", "7", "strict", 1.0),
    ("#### 1/2", "0.5", "strict", 1.0),
    ("#### 3/4", "0.75", "strict", 1.0),
    ("#### 2 1/2", "2.5", "strict", 1.0),
    ("#### \\frac{3}{4}", "0.75", "strict", 1.0),
    ("#### 1e3", "1000", "strict", 1.0),
    ("#### 1.5E2", "150", "strict", 1.0),
    ("#### 1 000", "1000", "strict", 1.0),
    ("#### 1\u2009000", "1000", "strict", 1.0),
    ("#### 1\u202f000\u202f000", "1000000", "strict", 1.0),
    ("#### 1,000", "1000", "strict", 1.0),
    ("#### 1,450,000", "1450000", "strict", 1.0),
    ("#### $1,234.50", "1234.5", "strict", 1.0),
    ("#### $18", "18", "strict", 1.0),
    ("#### 18$", "18", "strict", 1.0),
    ("#### 18 dollars", "18", "strict", 1.0),
    ("#### 12 eggs.", "12", "strict", 1.0),
    ("#### 50%", "50", "strict", 1.0),
    ("#### 18.", "18", "strict", 1.0),
    ("#### 18.00", "18", "strict", 1.0),
    ("#### 0.50", "0.5", "strict", 1.0),
    ("7 + 5 = 12 apples.\n#### 12\nI hope this helps!", "12", "strict", 1.0),
    ("#### 18", "She sells 9 * 2 = <<9*2=18>>18 eggs.\n#### 18", "strict", 1.0),
    ("So she ends with \u22125 dollars.", "-5", "flexible", 1.0),
    ("The answer is 1/2.", "0.5", "flexible", 1.0),
    ("The total is 1,000 dollars.", "1000", "flexible", 1.0),
    # wrong numbers
    ("#### 41", "42", "strict", 0.0),
    ("#### 5", "-5", "strict", 0.0),
    ("#### 1/3", "0.33", "strict", 0.0),
    ("#### 1e3", "100", "strict", 0.0),
    # lists and ambiguous separators are not an answer
    ("#### 1,2,3", "123", "strict", 0.0),
    ("#### 1 2 3", "123", "strict", 0.0),
    ("#### 12,34", "1234", "strict", 0.0),
    ("#### 1,0000", "10000", "strict", 0.0),
    ("#### 1.2.3", "1.23", "strict", 0.0),
    ("#### 17, 18", "18", "strict", 0.0),
    ("#### 18, 17", "18", "strict", 0.0),
    # two answers
    ("#### 17 18", "18", "strict", 0.0),
    ("#### 17 or 18", "18", "strict", 0.0),
    ("#### 18 or 17", "18", "strict", 0.0),
    ("#### 18 - 2", "18", "strict", 0.0),
    # no answer
    ("", "18", "strict", 0.0),
    ("#### ", "18", "strict", 0.0),
    ("####", "18", "strict", 0.0),
    ("#### .", "18", "strict", 0.0),
    ("#### -", "18", "strict", 0.0),
    ("#### eighteen", "18", "strict", 0.0),
    ("!!?? \u2014 ## ##", "18", "strict", 0.0),
    ("The answer is 18.", "18", "strict", 0.0),
]

# (solution, ground truth, human score)
MATH_CASES = [
    (r"so \boxed{2\sqrt2}", r"\sqrt8", 1.0),
    (r"\boxed{2x+1}", "1+2x", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"So the answer is $\frac34$.", "0.75", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0),
    (r"\boxed{3\sqrt{2}}", r"\sqrt{18}", 1.0),
    (r"\boxed{\frac{x+1}{2}}", r"\frac{x}{2}+\frac12", 1.0),
    (r"\boxed{(x-1)(x+1)}", "x^2-1", 1.0),
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", 1.0),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", 1.0),
    (r"\boxed{\dfrac{\pi}{2}}", r"\frac{\pi}2", 1.0),
    (r"\boxed{\frac{\sqrt2}{2}}", r"\frac{1}{\sqrt2}", 1.0),
    (r"\boxed{5 \text{ dollars}}", "5", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"We get $\boxed{\dfrac{1}{2}}$.", r"Hence $\boxed{0.5}$.", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{\frac13}", "0.33", 0.0),
    (r"\boxed{(1,2)}", "(2,1)", 0.0),
    (r"\boxed{x}", "y", 0.0),
    (r"\boxed{2x+2}", "2x+1", 0.0),
    (r"\boxed{\sqrt{7}}", r"\sqrt8", 0.0),
    (r"\boxed{x^2+2x}", "(x+1)^2", 0.0),
    (r"\boxed{x^3}", "x^2", 0.0),
    (r"\boxed{-2}", "2", 0.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{1,2}", "12", 0.0),
    (r"\boxed{}", "5", 0.0),
    ("I do not know.", "5", 0.0),
]


@pytest.mark.parametrize(("solution", "truth", "method", "human"), GSM8K_CASES)
def test_gsm8k_agrees_with_the_grader(solution, truth, method, human):
    assert gsm8k.compute_score(solution, truth, method=method) == human


@pytest.mark.parametrize(("solution", "truth", "human"), MATH_CASES)
def test_math_agrees_with_the_grader(solution, truth, human):
    assert math_equiv.compute_score(solution, truth) == human
