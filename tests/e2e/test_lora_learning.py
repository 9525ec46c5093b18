"""LoRA learns the toy task (issue 56): the default CPU profile with rank-4 adapters on
every projection of the warm-started tiny model, at a higher lr than full weights take."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pipeline.models import load_model
from tests.e2e.cli_run import cli_run, step_records

LORA = (
    *("--learner.lora.rank", "4", "--learner.lora.alpha", "16"),
    *("--learner.trainer.lr", "5e-3"),
)


@pytest.mark.slow
def test_a_lora_run_learns_with_a_tenth_of_the_optimizer_state(tmp_path: Path) -> None:
    """~5-7 minutes on 2 cores: the mean reward from <= 0.2 over the first 10 steps to >= 0.6
    over the last 10; Adam's state, the adapters', is at most a tenth of a full fine-tune's
    (two float32 moments of every parameter)."""
    run = cli_run(tmp_path, "lora", *LORA, timeout=1500)
    steps = step_records(run)
    assert len(steps) == 500, len(steps)
    rewards = [s["reward_mean"] for s in steps]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert first <= 0.2 and last >= 0.6, (first, last)
    full_bytes = 8 * sum(p.numel() for p in load_model(run / "model").parameters())
    lora_bytes = steps[-1]["actor/optimizer_state_bytes"]
    assert lora_bytes <= 0.1 * full_bytes, (lora_bytes, full_bytes)
    adapter = run / "final_model_adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (run / "final_model" / "config.json").is_file()
