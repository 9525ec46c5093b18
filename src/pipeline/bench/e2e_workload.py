"""The one-GPU e2e workload (docs/performance.md): a random 0.5B-shape model, 32 prompts of
62 tokens x 8 samples a step, 256 new tokens each (every sample runs to the limit), eight
optimizer steps a step, a KL loss to the reference; GRPO (critic off) or KL-PPO with the
critic. `workload_overrides` writes its prompts file and returns the run's overrides."""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT_TOKENS = 62
ROWS = 4096

WORKLOAD = [
    "--controller.prompts_per_step", "32",
    "--rollout.n_samples", "8",
    "--rollout.max_new_tokens", "256",
    "--rollout.ignore_eos", "true",
    "--learner.trainer.mini_batches", "8",
    "--algorithm.use_kl_loss", "true",
    "--algorithm.kl_loss_coef", "0.001",
]  # fmt: skip

VARIANTS = {
    "grpo": [
        "--critic.enabled", "false",
        "--services.critic.replicas", "0",
        "--algorithm.advantage_estimator", "grpo",
        "--algorithm.whiten_advantages", "false",
    ],
    "ppo": [],  # the profile's KL-PPO with the critic
}  # fmt: skip


def write_prompts(path: Path, tokenizer_dir: Path, *, tokens: int = PROMPT_TOKENS) -> Path:
    """ROWS toy_reverse prompts of exactly `tokens` tokens under the model's tokenizer."""
    from pipeline.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    rng = random.Random(0)
    frame = "reverse {} ="
    fixed = len(tokenizer.encode(frame.format("")))
    with path.open("w") as out:
        for i in range(ROWS):
            digits = "".join(rng.choice("0123456789") for _ in range(tokens - fixed))
            prompt = frame.format(digits)
            n = len(tokenizer.encode(prompt))
            if n != tokens:
                raise SystemExit(f"a workload prompt has {n} tokens, not {tokens}: {prompt!r}")
            row = {
                "uid": f"e2e-{i}",
                "data_source": "toy_reverse",
                "prompt": prompt,
                "reward_model": {"ground_truth": digits[::-1]},
            }
            out.write(json.dumps(row) + "\n")
    return path


def workload_overrides(variant: str, model_dir: Path, data_dir: Path) -> list[str]:
    """The workload's overrides for `variant` (grpo, ppo), its prompts written under
    `data_dir` with the tokenizer in `model_dir`."""
    if variant not in VARIANTS:
        raise SystemExit(f"--variant: one of {', '.join(VARIANTS)} (got {variant!r})")
    data = write_prompts(data_dir / "e2e-prompts.jsonl", model_dir)
    return [
        *WORKLOAD,
        "--task.dataset", str(data),
        "--task.max_prompt_tokens", str(PROMPT_TOKENS),
        *VARIANTS[variant],
    ]  # fmt: skip
