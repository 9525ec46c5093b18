"""Light processes import no torch: rewards and data run in light services (reward
workers start per timeout), and `pipeline run` spawns the services before it would have
imported torch (seconds on a host whose packages hold no bytecode)."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT = {
    "rewards_and_data": [
        "pipeline.rewards.scorer",
        "pipeline.rewards.gsm8k",
        "pipeline.rewards.math_equiv",
        "pipeline.rewards.symbolic",
        "pipeline.rewards.format",
        "pipeline.data.loader",
        "pipeline.data.cursor",
        "pipeline.data.gsm8k",
        "pipeline.tasks.toy_task",
        "pipeline.data.tokenizer",
    ],
    # every schema and codec: a light service decodes them too
    "wire": [
        "pipeline.wire.codec",
        "pipeline.wire.messages",
        "pipeline.wire.samples",
        "pipeline.wire.recording",
        "pipeline.wire.roles",
        "pipeline.wire.weights",
        "pipeline.wire.env",
        "pipeline.wire.reward",
    ],
    "launcher": [
        "pipeline.cli",
        "pipeline.commands.run",
        "pipeline.runtime.supervisor",
        "pipeline.runtime.bytecode",
        "pipeline.config",
    ],
}


@pytest.mark.parametrize("group", sorted(LIGHT))
def test_light_modules_do_not_import_torch_or_transformers(group: str):
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in LIGHT[group])
        + "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        + "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_launcher_loads_a_gpu_profile_without_torch():
    """A GPU profile's kernels ("auto": inductor options among them) are derived where the
    trainer builds, which imports torch anyway: the launcher loads it without torch."""
    code = (
        "import sys\n"
        "from pipeline.config import load_config\n"
        "config = load_config('profiles/h200-single.toml', {})\n"
        "assert config.learner.trainer.kernels == 'auto'\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
