"""Issue 56 item 1, any causal LM: tiny random checkpoints of families the native decoder
does not implement (Gemma 2/3, Qwen3-MoE, Mixtral, Phi-3, OLMo 2) train for 3 steps of
`pipeline run` through transformers' modeling, the rollout on the hf engine, GRPO
(profiles/local-cpu.toml) and KL-PPO with the critic (profiles/local-cpu-ppo.toml); every
role logs which modeling it took, and the exported final model loads in
AutoModelForCausalLM with the learner's logits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.cli_run import cli_run, log_events
from tests.hf_families import make_family

SHORT = (
    *("--rollout.engine", "hf", "--controller.steps", "3", "--controller.prompts_per_step", "4"),
    *("--rollout.n_samples", "4", "--services.reward.replicas", "1"),
)
PROFILES = {"grpo": "profiles/local-cpu.toml", "ppo": "profiles/local-cpu-ppo.toml"}


def run_family(tmp_path, family: str, algorithm: str):
    model = make_family(family, tmp_path / family)
    run = cli_run(
        tmp_path / "runs",
        f"{family}-{algorithm}",
        *("--model.path", str(model), *SHORT),
        profile=PROFILES[algorithm],
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 3
    roles = {"learner": "transformers", "rollout": "transformers"}
    if algorithm == "ppo":
        roles["critic"] = "transformers"
    for role, implementation in roles.items():
        [event] = log_events(run / "logs" / f"{role}-0.log", "model_implementation")
        assert event["role"] == role and event["implementation"] == implementation
        assert event["model_type"] == family and event["reason"]
    first = json.loads((run / "metrics/steps.jsonl").read_text().splitlines()[0])
    # the engine's transformers and the learner's: the same log-probs of the same weights
    assert first["mismatch/same_version_frac"] == 1.0
    assert first["mismatch/max_abs_diff"] < 1e-4
    return run


def assert_export_has_the_learners_logits(run) -> None:
    from transformers import AutoModelForCausalLM

    from pipeline.models.hf_causal import load_for_training

    final = run / "final_model"
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    learner = load_for_training(final)  # the learner's modeling of the trained weights
    ids = torch.randint(
        3, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, learner(ids), atol=1e-5, rtol=0)


def test_gemma2_trains_with_grpo_through_transformers_and_exports(tmp_path):
    run = run_family(tmp_path, "gemma2", "grpo")
    assert_export_has_the_learners_logits(run)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "algorithm"),
    [
        ("gemma3_text", "grpo"),
        ("qwen3_moe", "grpo"),
        ("mixtral", "grpo"),
        ("phi3", "grpo"),
        ("olmo2", "grpo"),
        ("gemma2", "ppo"),
        ("gemma3_text", "ppo"),
        ("qwen3_moe", "ppo"),
        ("mixtral", "ppo"),
        ("phi3", "ppo"),
        ("olmo2", "ppo"),
    ],
)
def test_a_family_trains_through_transformers(tmp_path, family, algorithm):
    run = run_family(tmp_path, family, algorithm)
    assert_export_has_the_learners_logits(run)


@pytest.mark.slow
def test_a_moe_model_trains_sharded_per_decoder_layer(tmp_path):
    """KL-PPO of Qwen3-MoE with a learner and a critic of 2 FSDP ranks each (gloo): the
    transformers model sharded per decoder layer, gathered for the engine and the export."""
    model = make_family("qwen3_moe", tmp_path / "qwen3_moe")
    run = cli_run(
        tmp_path / "runs",
        "sharded",
        *("--model.path", str(model), *SHORT),
        *("--services.learner.fsdp_size", "2", "--services.critic.fsdp_size", "2"),
        profile=PROFILES["ppo"],
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 3
    first = json.loads((run / "metrics/steps.jsonl").read_text().splitlines()[0])
    assert first["mismatch/same_version_frac"] == 1.0
    assert first["mismatch/max_abs_diff"] < 1e-4
    assert_export_has_the_learners_logits(run)
