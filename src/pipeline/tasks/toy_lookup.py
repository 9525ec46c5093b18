"""The toy tool task: answer with a key's value, which only a lookup tool knows.

"find 37 =" asks for the value of key 37: three digits from a fixed table the model cannot
compute (a seeded hash of the key). The policy's first turn should be the call `?` (the
environment's stop string); the tool answers " 482 =" as environment tokens, and the next
turn should be "482" and end-of-sequence. The reward is 1 for the right final answer only.

The tiny model's warm start (`pipeline.tasks.warm_start`, task "copy_ask") copies the digits
before the last " =" after any other instruction word ("wxyz 482 =" -> "482", also after an
earlier call: "wxyz 37 =? 482 =" -> "482"), and answers `?` to a first question now and then
whatever its word. It never sees "find": RL has to learn that calling pays for "find" and to
answer with what the tool returned.
"""

from __future__ import annotations

import hashlib
import random

from pipeline.data.records import PromptRecord

DATA_SOURCE = "toy_lookup"
KEY_DIGITS = (2, 3)


def lookup_value(key: str) -> str:
    """The table's value of `key`: three digits, the same on every machine."""
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return f"{int.from_bytes(digest) % 1000:03d}"


def lookup_prompt(key: str) -> str:
    return f"find {key} ="


def make_lookup_dataset(n: int, seed: int = 0) -> list[PromptRecord]:
    """`n` lookup prompts, the same for the same `seed` on every machine."""
    if n < 0:
        raise ValueError(f"need n >= 0, got {n}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        key = "".join(rng.choice("0123456789") for _ in range(rng.choice(KEY_DIGITS)))
        records.append(
            PromptRecord(
                uid=f"{DATA_SOURCE}:{seed}:{i}",
                prompt_text=lookup_prompt(key),
                data_source=DATA_SOURCE,
                ground_truth=lookup_value(key),
                extra_info={"index": i, "key": key},
            )
        )
    return records
