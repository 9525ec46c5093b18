"""bench.e2e's agentic workload at a tiny size on the CPU: multi-turn episodes of the toy
tool task whose calls wait, and the per-episode figures beside the e2e ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_e2e_agentic_workload_cpu(tmp_path: Path) -> None:
    out_file = tmp_path / "e2e.json"
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "bench.e2e", "--workload", "agentic", "--tool-delay-s", "0.05"]
    cmd += ["--warm-start-steps", "40", "--steps", "4", "--skip", "1", "--staleness", "1"]
    cmd += ["--json", str(out_file), "--runs-dir", str(runs)]
    cmd += ["--controller.prompts_per_step", "2", "--rollout.n_samples", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (fig,) = json.loads(out_file.read_text())
    config = fig["config"]
    assert fig["figure"] == "samples_per_s_staleness1_local-cpu-tool_agentic"
    assert config["workload"] == "agentic (tool delay median 0.05s)"
    assert fig["value"] > 0 and config["samples_per_step"] == 2 * 4
    assert config["turns_per_episode"] > 1  # the warm start calls the tool on most first turns
    assert config["tool_calls_per_episode"] > 0 and config["env_s_per_episode"] > 0
    # 0 where the engine keeps an episode's cache across its turns
    assert config["recomputed_tokens_per_episode"] >= 0
    assert config.get("prefill_tokens_per_episode", 1.0) > 0  # where the run counts it
    run = json.loads((runs / "e2e-local-cpu-tool-s1/config.json").read_text())
    options = run["environment"]["options"]
    assert (options["tool_delay_s"], options["tool_delay_sigma"]) == (0.05, 0.8)
    assert run["environment"]["name"] == "toy_lookup" and run["task"]["dataset"] == "toy_lookup"
    assert run["algorithm"]["advantage_estimator"] == "grpo" and not run["critic"]["enabled"]


@pytest.mark.parametrize("char_vocab", [True, False])
def test_the_random_agentic_model_ends_turns_at_the_tool_call(
    tmp_path: Path, char_vocab: bool
) -> None:
    """The GPU preset's random model must call the tool now and then, or its episodes are
    single 256-token turns: with the shape's own vocabulary it almost never samples `?`."""
    import torch
    from bench.e2e import shape_model

    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.envs.toy_lookup import CALL
    from pipeline.models import load_model

    shape_model("tiny", tmp_path, "cpu", char_vocab=char_vocab)
    tokenizer = load_tokenizer(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert (model.config.vocab_size == len(tokenizer)) is char_vocab
    call = tokenizer.convert_tokens_to_ids(CALL)
    torch.manual_seed(0)
    ids = torch.tensor([tokenizer.encode("reverse 123 =")] * 32)
    called = torch.zeros(32, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(64):
            probs = model(ids)[:, -1].float().softmax(-1)
            token = torch.multinomial(probs, 1)
            called |= token[:, 0] == call
            ids = torch.cat([ids, token], 1)
    assert (called.float().mean().item() > 0.25) is char_vocab, called.float().mean()
