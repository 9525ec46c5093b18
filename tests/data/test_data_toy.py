from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.rewards.registry import auto_reward, resolve
from pipeline.tasks.toy_task import DATA_SOURCE, make_toy_dataset, toy_prompt, toy_reward


def test_dataset_is_deterministic_and_well_formed():
    records = make_toy_dataset(200, seed=5)
    assert records == make_toy_dataset(200, seed=5)
    assert records != make_toy_dataset(200, seed=6)
    assert len({r.uid for r in records}) == 200
    for r in records:
        digits = r.extra_info["digits"]
        assert 3 <= len(digits) <= 5 and digits.isdigit()
        assert r.prompt_text == toy_prompt(digits)
        assert r.ground_truth == digits[::-1]
        assert r.data_source == DATA_SOURCE
    assert {len(r.ground_truth) for r in records} == {3, 4, 5}


@pytest.mark.parametrize(
    ("answer", "truth", "expected"),
    [
        ("4321", "4321", 1.0),
        ("4321" + " " * 12, "4321", 0.25),  # padded to the limit instead of stopping
        (" 4321", "4321", 0.0),
        ("4320", "4321", 0.75),
        ("432", "4321", 0.75),
        ("43210", "4321", 0.8),
        ("1234", "4321", 0.0),
        ("", "4321", 0.0),
        ("   ", "4321", 0.0),
        ("abcd", "4321", 0.0),
    ],
)
def test_partial_credit_with_length_penalty(answer, truth, expected):
    assert toy_reward(answer, truth) == pytest.approx(expected)


@given(answer=st.text(max_size=12), truth=st.text(alphabet="0123456789", min_size=3, max_size=5))
def test_reward_is_in_unit_interval(answer, truth):
    assert 0.0 <= toy_reward(answer, truth) <= 1.0


def test_registered_under_its_data_source():
    assert resolve("toy_reverse")(DATA_SOURCE, "321", "321", None) == 1.0
    assert auto_reward(DATA_SOURCE, "32", "321", None) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="min_digits"):
        make_toy_dataset(3, min_digits=4, max_digits=3)


def test_alphabet_restricts_the_digits():
    records = make_toy_dataset(100, seed=1, alphabet="01")
    assert {c for r in records for c in r.extra_info["digits"]} == {"0", "1"}
    with pytest.raises(ValueError, match="alphabet"):
        make_toy_dataset(3, alphabet="ab")


def test_warm_start_trains_in_place_on_copying(tmp_path):
    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
    from pipeline.models import load_model
    from pipeline.tasks.tiny_model import make_tiny_model
    from pipeline.tasks.warm_start import warm_prompt, warm_start

    assert warm_prompt("copy", "3917") == ("copy 3917 =", "3917")
    with pytest.raises(ValueError, match="warm-start task"):
        warm_prompt("reverse", "3917")
    directory = save_char_tokenizer(tmp_path / "model")
    make_tiny_model(directory, vocab_size=len(load_tokenizer(directory)), hidden=32)
    before = {k: v.clone() for k, v in load_model(directory).state_dict().items()}
    warm_start(directory, steps=2, batch_size=4)
    after = load_model(directory).state_dict()
    assert any(not (before[k] == after[k]).all() for k in before)
