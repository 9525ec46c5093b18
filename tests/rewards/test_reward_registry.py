from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.rewards.registry import (
    BUILTIN_REWARDS,
    RewardNotFound,
    auto_reward,
    is_builtin,
    resolve,
    reward_name_for,
)


def test_builtins_resolve_with_the_uniform_signature():
    assert {"gsm8k", "math", "format", "toy_reverse", "auto"} <= set(BUILTIN_REWARDS)
    assert resolve("gsm8k")("openai/gsm8k", "#### 7", "7", None) == 1.0
    assert resolve("math")("math", r"\boxed{\frac12}", "0.5", None) == 1.0
    assert resolve("format")("openai/gsm8k", "#### 7", "", None) == 1.0
    assert resolve("toy_reverse")("toy_reverse", "321", "321", None) == 1.0
    assert all(is_builtin(name) for name in BUILTIN_REWARDS)
    assert not is_builtin("pkg.mod:fn")


@pytest.mark.parametrize(
    ("data_source", "name"),
    [
        ("openai/gsm8k", "gsm8k"),
        ("gsm8k", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("toy_reverse", "toy_reverse"),
        ("someone/gsm8k", "gsm8k"),
    ],
)
def test_auto_dispatch_by_data_source(data_source, name):
    assert reward_name_for(data_source) == name


def test_auto_reward_scores_and_refuses_unknown_sources():
    assert auto_reward("openai/gsm8k", "#### 1,000", "1000", None) == 1.0
    assert auto_reward("toy_reverse", "123", "124", None) == pytest.approx(2 / 3)
    with pytest.raises(RewardNotFound, match="no built-in reward for data_source 'mystery'"):
        auto_reward("mystery", "1", "1", None)


def test_user_functions_by_module_and_by_file(user_rewards):
    fn = resolve("pipeline.rewards.gsm8k:reward_fn")
    assert fn("gsm8k", "#### 2", "2", None) == 1.0
    exact = resolve(f"{user_rewards}:exact")
    assert exact("x", " 5 ", "5", None) == 1.0
    assert resolve(f"{user_rewards}:exact") is exact  # the file is loaded once


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_reward", "unknown reward 'no_such_reward'; built-ins are"),
        ("no_such_pkg_xyz.mod:fn", "module 'no_such_pkg_xyz.mod' not found"),
        ("pipeline.rewards.gsm8k:missing", "has no attribute 'missing'"),
        ("pipeline.rewards.gsm8k:re", "is not callable"),
        ("/nonexistent/rewards.py:fn", "does not exist"),
        (":fn", "unknown reward"),
    ],
)
def test_bad_specs_raise_a_typed_error(spec, message):
    with pytest.raises(RewardNotFound, match=message.replace("(", r"\(")) as info:
        resolve(spec)
    assert isinstance(info.value, ConfigError)


def test_a_user_file_that_fails_on_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise ImportError('missing dependency foo')\n")
    with pytest.raises(RewardNotFound, match="missing dependency foo"):
        resolve(f"{bad}:fn")


def test_a_user_attribute_that_is_not_callable(user_rewards):
    with pytest.raises(RewardNotFound, match="is not callable"):
        resolve(f"{user_rewards}:NOT_CALLABLE")
