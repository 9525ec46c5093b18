from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.rewards.format import FormatReward, reward_fn, reward_for


def test_search_and_fullmatch():
    rule = FormatReward(pattern=r"<answer>\d+</answer>", score=0.5, penalty=-0.1)
    assert rule("think... <answer>42</answer>") == 0.5
    assert rule("42") == -0.1
    strict = FormatReward(pattern=r"<answer>\d+</answer>", mode="fullmatch")
    assert strict("<answer>42</answer>") == 1.0
    assert strict("x <answer>42</answer>") == 0.0


def test_defaults_per_data_source():
    assert reward_fn("openai/gsm8k", "so\n#### 1,234", "1234", None) == 1.0
    assert reward_fn("openai/gsm8k", "the answer is 1234", "1234", None) == 0.0
    assert reward_fn("math", r"so \boxed{\frac12}", "", None) == 1.0
    assert reward_fn("toy_reverse", " 4321 ", "", None) == 1.0
    assert reward_fn("toy_reverse", "4321 and more", "", None) == 0.0
    assert reward_fn("unknown", "<answer>x</answer>", "", None) == 1.0


def test_extra_info_overrides_pattern_and_scores():
    info = {"format_pattern": r"^ANSWER: ", "format_score": 0.2, "format_penalty": -1.0}
    assert reward_fn("gsm8k", "ANSWER: 3", "3", info) == 0.2
    assert reward_fn("gsm8k", "#### 3", "3", info) == -1.0
    assert reward_for("gsm8k", {"format_mode": "fullmatch", "format_pattern": "a"}).mode == (
        "fullmatch"
    )


def test_bad_configuration_is_a_config_error():
    with pytest.raises(ConfigError, match="not a valid regex"):
        FormatReward(pattern="(unclosed")
    with pytest.raises(ConfigError, match="mode"):
        FormatReward(pattern="x", mode="prefix")  # type: ignore[arg-type]
