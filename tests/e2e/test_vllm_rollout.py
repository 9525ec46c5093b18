"""`rollout.engine = "vllm"`: a short run on vLLM's CPU backend. The learner's weights reach
the engine every step: it applies each published version and its behaviour log-probs stay
the learner's while the weights move away from the initial ones."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed (make test-vllm)")

from tests.e2e.cli_run import cli_run, log_events, step_records  # noqa: E402

STEPS = 4


def _policy_dir(path: Path) -> Path:
    """The toy task's tiny tied Qwen2 with head_dim 64 (vLLM's CPU attention refuses the
    default model's 16), next to the char tokenizer."""
    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
    from pipeline.models import CausalLM, save_model
    from pipeline.tasks.tiny_model import tiny_config

    save_char_tokenizer(path)
    config = tiny_config(len(load_tokenizer(path)), hidden=128).replace(
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256
    )
    torch.manual_seed(0)
    model = CausalLM(config)
    model.init_weights()
    save_model(model, path)
    return path


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm_run")
    model = _policy_dir(root / "policy")
    runs = root / "runs"
    # the supervisor's services inherit these (the Makefile's test-vllm sets them too)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # exact token versions
    run = cli_run(
        runs,
        "vllm",
        "--rollout.engine", "vllm",
        "--model.path", str(model),
        "--task.warm_start_steps", "0",
        "--controller.steps", str(STEPS),
        # synchronous: every sample comes from the weights the learner then holds, so
        # the mismatch measures the engine alone, not the policy's lag
        "--controller.max_staleness", "0",
        "--controller.prompts_per_step", "8",
        "--controller.max_inflight_prompts", "8",
        "--rollout.n_samples", "4",
        env=env,
    )  # fmt: skip
    return run, model


def test_the_run_completes_and_the_engine_applies_every_version(vllm_run):
    run, _ = vllm_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["duplicates"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    applied = {e["version"] for e in log_events(run / "logs/rollout-0.log", "weight_sync_applied")}
    assert applied == set(range(STEPS + 1))  # the initial weights, then one per step


def test_behaviour_logprobs_follow_the_learners_weights(vllm_run):
    """mismatch/kl compares the engine's log-probs with the learner's recomputation under
    the weights it trains: float32 round-off on every step while the weights change each
    step (an lm_head left on the initial weights gave 2e-2 to 4e-2 from step 1 on)."""
    run, _ = vllm_run
    steps = step_records(run)
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["mismatch/kl"] < 1e-4, (s["step"], s["mismatch/kl"])
        assert s["actor/grad_norm"] > 0, s["step"]


def test_the_last_steps_samples_come_from_trained_weights(vllm_run):
    """Counterfactual: under the initial weights the last step's samples are much less
    likely to match the engine's log-probs, so the small mismatch is not the engine still
    serving version 0."""
    from pipeline.models import load_model
    from pipeline.wire.recording import QueueReader

    run, model_dir = vllm_run
    step_of = {}
    for line in (run / "schedule.jsonl").read_text().splitlines():
        record = json.loads(line)
        step_of[record["uid"]] = record["step"]
    initial = load_model(model_dir).eval()
    drift: list[float] = []
    for record in QueueReader(run / "queues/scored.log"):
        message = record.decode()
        prompt = message.tensor(message.body.prompt_ids).tolist()
        for sample in message.body.samples:
            versions = message.tensor(sample.token_versions)
            assert step_of.get(sample.uid, versions.min()) == versions.min() == versions.max()
            if versions.min() != STEPS - 1:
                continue
            response = message.tensor(sample.response_ids).tolist()
            with torch.no_grad():
                logits = initial(torch.tensor([prompt + response]))[0, len(prompt) - 1 : -1]
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            behaviour = message.tensor(sample.behaviour_logprobs)
            drift.append(float(np.abs(logp.numpy() - behaviour).mean()))
    assert drift, "no sample of the last step was recorded"
    last = step_records(run)[-1]
    assert np.mean(drift) > 10 * last["mismatch/mean_abs_diff"], (drift, last)
