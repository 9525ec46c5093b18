"""The one-GPU e2e workloads (docs/performance.md): a random 0.5B-shape model, 32 prompts of
62 tokens x 8 samples a step, eight optimizer steps a step, a KL loss to the reference;
GRPO (critic off) or KL-PPO with the critic. Every row says `ignore_eos`, so each sample
runs to its prompt's budget: 256 new tokens for every prompt (`fixed`), or a budget per
prompt from a lognormal capped at `cap` (`long-tail`: median cap / 4, sigma 0.8; a
prompt's samples share it), the long tail of response lengths that reasoning tasks have.
`workload_overrides` writes its prompts file and returns the run's overrides.

`agentic`: the toy tool task (pipeline.tasks.toy_lookup) as multi-turn GRPO episodes whose
tool calls wait, as a remote tool's would, a time drawn per call from a lognormal (median
`delay_s`, sigma 0.8, seeded per episode: the same waits in every run). On the CPU it runs
the profile's sizes with the tiny model
warm-started to call the tool on most first turns (`agentic_model`), so episodes are a call, the tool's answer and the final answer; on a GPU
(`gpu=True`) the one-GPU sizes, up to 256 tokens and 4 turns an episode, with the random
model of the preset's shape and the characters' vocabulary, whose turns end at the call `?`
or end-of-sequence (about 2 turns an episode)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

PROMPT_TOKENS = 62
ROWS = 4096

WORKLOADS = ("fixed", "long-tail", "agentic")
FIXED_TOKENS = 256
WORKLOAD = [
    "--controller.prompts_per_step", "32",
    "--rollout.n_samples", "8",
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


def long_tail_budgets(rows: int, cap: int, *, seed: int = 0) -> list[int]:
    """`rows` response budgets from a lognormal of median cap / 4 and sigma 0.8, each
    rounded and held to [1, cap] (about 4 % of prompts reach the cap)."""
    rng = random.Random(seed)
    mu = math.log(cap / 4)
    return [min(cap, max(1, round(rng.lognormvariate(mu, 0.8)))) for _ in range(rows)]


def write_prompts(
    path: Path,
    tokenizer_dir: Path,
    *,
    tokens: int = PROMPT_TOKENS,
    budgets: list[int] | None = None,
) -> Path:
    """ROWS toy_reverse prompts of exactly `tokens` tokens under the model's tokenizer,
    each ignoring end-of-sequence (its samples run to its budget), row i with response
    budget `budgets[i]` when given."""
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
                "ignore_eos": True,
            }
            if budgets is not None:
                row["max_new_tokens"] = budgets[i]
            out.write(json.dumps(row) + "\n")
    return path


def workload_overrides(
    variant: str,
    model_dir: Path,
    data_dir: Path,
    *,
    workload: str = "fixed",
    cap: int = 2048,
    prompt_tokens: int = PROMPT_TOKENS,
) -> list[str]:
    """The overrides of `workload` (fixed, long-tail) for `variant` (grpo, ppo), its prompts
    written under `data_dir` with the tokenizer in `model_dir`."""
    if variant not in VARIANTS:
        raise SystemExit(f"--variant: one of {', '.join(VARIANTS)} (got {variant!r})")
    if workload not in WORKLOADS:
        raise SystemExit(f"--workload: one of {', '.join(WORKLOADS)} (got {workload!r})")
    long_tail = workload == "long-tail"
    budgets = long_tail_budgets(ROWS, cap) if long_tail else None
    data = write_prompts(
        data_dir / "e2e-prompts.jsonl", model_dir, tokens=prompt_tokens, budgets=budgets
    )
    return [
        *WORKLOAD,
        "--rollout.max_new_tokens", str(cap if long_tail else FIXED_TOKENS),
        "--task.dataset", str(data),
        "--task.max_prompt_tokens", str(prompt_tokens),
        *VARIANTS[variant],
    ]  # fmt: skip


# the share of the warm start's first answers that are the tool call: most episodes call
ASK_SHARE = 0.85
TOOL_DELAY_SIGMA = 0.8
# the CPU engine's prompts at once: a step's (local-cpu-tool), not the CPU default of 8. Its


def agentic_model(directory: Path, *, steps: int = 120, seed: int = 0) -> list[str]:
    """The tiny model warm-started on copy_ask with a high share of calls, made once for
    every run of the bench; the overrides that use it."""
    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
    from pipeline.tasks.tiny_model import make_tiny_model
    from pipeline.tasks.warm_start import warm_start

    save_char_tokenizer(directory)
    make_tiny_model(directory, vocab_size=len(load_tokenizer(directory)), seed=seed)
    warm_start(directory, steps=steps, seed=seed, task="copy_ask", ask_share=ASK_SHARE)
    return ["--model.path", str(directory), "--task.warm_start_steps", "0"]


def agentic_overrides(variant: str, *, delay_s: float = 0.5, gpu: bool = False) -> list[str]:
    """The agentic workload's overrides for `variant` (its tool delay's median `delay_s`)."""
    if variant not in VARIANTS:
        raise SystemExit(f"--variant: one of {', '.join(VARIANTS)} (got {variant!r})")
    task = [
        "--task.dataset", "toy_lookup",
        "--environment.name", "toy_lookup",
        "--environment.options.tool_delay_s", str(delay_s),
        "--environment.options.tool_delay_sigma", str(TOOL_DELAY_SIGMA),
        "--reward.function", "environment",
    ]  # fmt: skip
    sizes = [
        *WORKLOAD,
        "--rollout.max_new_tokens", str(FIXED_TOKENS),
        "--environment.max_turns", "4",
    ]  # fmt: skip
    return [*task, *(sizes if gpu else []), *VARIANTS[variant]]
