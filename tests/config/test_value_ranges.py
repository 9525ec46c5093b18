"""Values out of range are refused when the config loads, the message naming the key and
the rule (issue 33, defect 8: accepted before, but for the checkpoint keys)."""

from __future__ import annotations

import re

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError

REFUSED = {
    "controller.max_inflight_prompts": ["0", "-3"],
    "controller.step_timeout_s": ["inf", "nan"],
    "controller.first_step_timeout_s": ["inf"],
    "rollout.max_new_tokens": ["0", "-1"],
    "rollout.temperature": ["-0.5"],
    "rollout.max_batch": ["0"],
    "rollout.top_k": ["0"],
    "learner.checkpoint_every": ["-1"],
    "learner.keep_checkpoints": ["0"],
    "reward.timeout_s": ["-1", "0"],
    "supervisor.max_restarts": ["-1"],
    "supervisor.stop_timeout_s": ["0"],
    "task.dataset_size": ["0", "-5"],
    "task.max_prompt_tokens": ["0"],
    "run.torch_threads": ["0"],
    "run.handshake_timeout_s": ["inf"],
}


@pytest.mark.parametrize(
    ("key", "value"), [(k, v) for k, values in REFUSED.items() for v in values]
)
def test_an_out_of_range_value_is_refused_naming_its_key(key: str, value: str):
    with pytest.raises(ConfigError, match=f"{re.escape(key)} (must be )?[>-]"):
        load_config("profiles/local-cpu.toml", {key: value})


def test_the_edges_of_the_ranges_load():
    edges = {
        "rollout.temperature": "0",
        "learner.checkpoint_every": "0",
        "supervisor.max_restarts": "0",
        "controller.first_step_timeout_s": "0",
        "rollout.top_k": "-1",
        "task.dataset_size": "1",
    }
    config = load_config("profiles/local-cpu.toml", edges)
    assert config.rollout.temperature == 0 and config.supervisor.max_restarts == 0
