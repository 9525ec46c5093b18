"""rollout.max_new_tokens_jitter: each prompt's response limit, drawn below max_new_tokens."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import PipelineConfig
from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
from pipeline.errors import ConfigError
from pipeline.runtime.journal import ReleasedPrompt
from services.controller import Controller


def limits(tmp_path, jitter: float, seed: int = 0) -> list[int]:
    base = PipelineConfig()
    config = dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, seed=seed),
        rollout=dataclasses.replace(base.rollout, max_new_tokens=200, max_new_tokens_jitter=jitter),
    )
    controller = Controller(config, tmp_path / f"run-{jitter}-{seed}")
    save_char_tokenizer(tmp_path / "tok")
    controller._tokenizer = load_tokenizer(tmp_path / "tok")
    out = []
    for i in range(40):
        released = ReleasedPrompt(f"{i:06d}:p{i}", "1+1=", "toy", "2", 0)
        prompt, _ = controller.encode(released)
        out.append(prompt.max_new_tokens)
    return out


def test_jitter_draws_each_prompt_a_limit_in_range_the_same_every_time(tmp_path):
    drawn = limits(tmp_path, 0.5)
    assert all(100 <= n <= 200 for n in drawn)
    assert len(set(drawn)) > 10  # they vary
    assert drawn == limits(tmp_path, 0.5)  # a restarted controller sends the same prompt
    assert drawn != limits(tmp_path, 0.5, seed=1)


def test_no_jitter_gives_every_prompt_max_new_tokens(tmp_path):
    assert set(limits(tmp_path, 0.0)) == {200}


def test_jitter_out_of_range_is_refused():
    rollout = PipelineConfig().rollout
    with pytest.raises(ConfigError, match="max_new_tokens_jitter"):
        dataclasses.replace(rollout, max_new_tokens_jitter=1.0).validate()
