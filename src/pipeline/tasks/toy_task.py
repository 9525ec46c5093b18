"""The default task: reverse a string of 3-5 digits.

Chosen so a tiny character-level transformer learns it by RL within minutes on a CPU: the
answer is short and fully determined by the prompt, every position can be checked on its own,
so the partial-credit reward gives a dense signal long before the first fully correct answer.

Recipe that learns it (2 CPU threads, GRPO, see `pipeline.tasks.warm_start`): a hidden-64, 2-layer
policy warm-started for 200 steps on *copying* digits ("copy 3917 =" -> "3917", never the
reversal instruction), then RL with 32 prompts x 8 samples per step, temperature 1.0,
max_new_tokens = MAX_DIGITS + 2, AdamW lr 3e-3, grad clip 1.0, one PPO epoch, one mini-batch.
Mean reward goes from about 0.15 over the first 10 RL steps to about 0.6 by step 200-300.
"""

from __future__ import annotations

import random
from typing import Any

from pipeline.data.records import PromptRecord

DATA_SOURCE = "toy_reverse"
MIN_DIGITS = 3
MAX_DIGITS = 5
ALPHABET = "0123456789"


def toy_prompt(digits: str) -> str:
    """The prompt for one instance; the completion should be the digits reversed."""
    return f"reverse {digits} ="


def make_toy_dataset(
    n: int,
    seed: int = 0,
    *,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    alphabet: str = ALPHABET,
) -> list[PromptRecord]:
    """`n` reversal prompts, the same for the same `seed` on every machine."""
    if n < 0 or not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"need n >= 0 and 1 <= min_digits <= max_digits, got {n}, {min_digits}, {max_digits}"
        )
    if not alphabet or not alphabet.isdigit():
        raise ValueError(f"alphabet must be a non-empty string of digits, got {alphabet!r}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        length = rng.randint(min_digits, max_digits)
        digits = "".join(rng.choice(alphabet) for _ in range(length))
        records.append(
            PromptRecord(
                uid=f"{DATA_SOURCE}:{seed}:{i}",
                prompt_text=toy_prompt(digits),
                data_source=DATA_SOURCE,
                ground_truth=digits[::-1],
                extra_info={"index": i, "digits": digits},
            )
        )
    return records


def toy_reward(solution_str: str, ground_truth: str) -> float:
    """Fraction of positions right, over the longer of answer and truth, in [0, 1].

    Dividing by the longer length is the length penalty: extra characters cost as much as
    missing ones, so the policy learns to stop. Whitespace the policy generated counts as
    characters: stripped, an answer padded with spaces up to the response limit (one that
    never stops) would score as if it had stopped.
    """
    answer = solution_str
    truth = ground_truth.strip()
    longest = max(len(answer), len(truth))
    if longest == 0:
        return 0.0
    correct = sum(a == t for a, t in zip(answer, truth, strict=False))
    return correct / longest


def reward_fn(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """Registry entry for data source `toy_reverse`."""
    return toy_reward(solution_str, ground_truth)
