from __future__ import annotations

import pytest

from pipeline.rewards.gsm8k import compute_score, extract_answer, normalize_number, reward_fn


def _truth(answer: str) -> str:
    """verl's way of deriving the ground truth from a GSM8K answer."""
    return answer.split("#### ")[1].replace(",", "").strip()


def test_strict_extraction_matches_every_real_answer(gsm8k_test_rows):
    assert len(gsm8k_test_rows) == 1319
    mismatches = [
        (row["answer"][-40:], extract_answer(row["answer"], "strict"))
        for row in gsm8k_test_rows
        if extract_answer(row["answer"], "strict") != _truth(row["answer"])
    ]
    assert mismatches == []


def test_every_real_answer_scores_full_and_a_wrong_truth_scores_zero(gsm8k_test_rows):
    for row in gsm8k_test_rows:
        truth = _truth(row["answer"])
        assert compute_score(row["answer"], truth) == 1.0
        assert compute_score(row["answer"], truth, method="flexible") == 1.0
        assert compute_score(row["answer"], str(int(truth) + 1)) == 0.0


def test_real_answers_without_the_marker_pass_flexible_only(gsm8k_test_rows):
    for row in gsm8k_test_rows[:200]:
        body, _, final = row["answer"].rpartition("#### ")
        rewritten = f"{body}So the answer is {final}."
        truth = _truth(row["answer"])
        assert compute_score(rewritten, truth, method="strict") == 0.0
        assert compute_score(rewritten, truth, method="flexible") == 1.0


@pytest.mark.parametrize(
    ("text", "truth", "strict", "flexible"),
    [
        ("so the total is\n#### 1,000", "1000", 1.0, 1.0),
        ("#### $18", "18", 1.0, 1.0),
        ("she pays $18.", "18", 0.0, 1.0),
        ("#### -10", "-10", 1.0, 1.0),
        ("#### 18.00", "18", 1.0, 1.0),
        ("#### 18.5", "18.50", 1.0, 1.0),
        ("#### 18 dollars, as computed above.", "18", 1.0, 1.0),
        ("#### 18 dollars, 3 more than before.", "18", 1.0, 0.0),
        ("#### 18.\nI hope this helps!", "18", 1.0, 1.0),
        ("#### 1,450,000", "1450000", 1.0, 1.0),
        ("I do not know.", "18", 0.0, 0.0),
        ("", "18", 0.0, 0.0),
        ("#### .", "18", 0.0, 0.0),
        ("#### 17", "18", 0.0, 0.0),
        ("#### 17\n#### 18", "18", 1.0, 1.0),
        ("#### 0.0", "0", 1.0, 1.0),
    ],
)
def test_edge_cases(text, truth, strict, flexible):
    assert compute_score(text, truth, method="strict") == strict
    assert compute_score(text, truth, method="flexible") == flexible


def test_flexible_takes_the_last_number_strict_the_last_marker():
    text = "#### 5\nActually, 6 + 1 = 7"
    assert extract_answer(text, "strict") == "5"
    assert extract_answer(text, "flexible") == "7"
    assert extract_answer("Total: 2, 3, and finally 4.", "flexible") == "4"
    assert extract_answer("Total: 2, 3, and finally 4.", "strict") is None


def test_format_score_rewards_a_wrong_but_well_formed_answer():
    assert compute_score("#### 17", "18", format_score=0.1) == 0.1
    assert compute_score("no answer", "18", format_score=0.1) == 0.0
    assert compute_score("#### 18", "18", score=2.0) == 2.0


def test_ground_truth_may_be_a_full_worked_answer():
    assert compute_score("#### 2125", "5 * 425 = <<5*425=2125>>2125\n#### 2,125") == 1.0


@pytest.mark.parametrize(
    ("raw", "canon"),
    [("1,000", "1000"), ("$5", "5"), ("5.", "5"), ("-0", "0"), ("18.50", "18.5"), ("1e2", "100")],
)
def test_normalize_number(raw, canon):
    assert normalize_number(raw) == canon


def test_reward_fn_reads_method_and_scores_from_extra_info():
    assert reward_fn("openai/gsm8k", "it is 18", "18", None) == 0.0
    assert reward_fn("openai/gsm8k", "it is 18", "18", {"method": "flexible"}) == 1.0
    assert reward_fn("openai/gsm8k", "#### 3", "18", {"format_score": 0.2}) == 0.2


def test_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="strict"):
        extract_answer("#### 1", "loose")  # type: ignore[arg-type]
