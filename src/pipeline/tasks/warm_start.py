"""A short supervised warm start for the tiny policy on a related task (copying digits).

A freshly initialised model first has to discover the answer format (digits, the right
length, then `<eos>`) before RL can teach it the task itself. This trains the saved model in
place with cross-entropy on a *different* instruction ("copy 3917 =" -> "3917"), so it learns
the format and to attend to the digits, and then saves it back. It is never trained on the
toy task's own instruction: RL still starts low on reversal and has to learn it.

The stop rule is a fixed number of steps for a fixed seed, so the warm start is deterministic.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from pipeline.tasks.toy_task import ALPHABET, MAX_DIGITS, MIN_DIGITS

WARM_TASKS = ("copy", "copy_ask")
# copy_ask: the share of first answers that are the call `?`, whatever the instruction word
ASK_SHARE = 0.12


def _word(rng: random.Random) -> str:
    """An instruction word: any 3-5 letters but "find" (the lookup task's)."""
    while True:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 5)))
        if word != "find":
            return word


def warm_prompt(
    task: str, digits: str, rng: random.Random | None = None, ask_share: float = ASK_SHARE
) -> tuple[str, str]:
    """(prompt, completion) for one warm-start instance.

    copy_ask (the toy tool task's): "<word> 482 =" -> "482", or, for a share of rows and
    whatever the word, "<word> 37 =" -> "?"; after an earlier call ("<word> 37 =? 482 =") the
    answer is always the digits before the last " =". The model can then read a tool's answer,
    and `?` is a first answer it samples now and then for any instruction; it never sees the
    lookup instruction "find", nor that calling pays."""
    if task == "copy":
        return f"copy {digits} =", digits
    if task != "copy_ask" or rng is None:
        raise ValueError(f"unknown warm-start task {task!r}; known: {WARM_TASKS}")
    word = _word(rng)
    if rng.random() < 0.5:
        return f"{word} {rng.randint(0, 999)} =? {digits} =", digits
    if rng.random() < ask_share:
        return f"{word} {digits} =", "?"
    return f"{word} {digits} =", digits


def warm_start(
    model_dir: str | Path,
    *,
    steps: int = 200,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 64,
    task: str = "copy",
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    alphabet: str = ALPHABET,
    ask_share: float = ASK_SHARE,
) -> Path:
    """Train the model saved in `model_dir` for `steps` AdamW steps on `task`; save it back.
    `ask_share`: copy_ask's share of first answers that are the call `?`."""
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.models import load_model, save_model

    if steps < 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0 and batch_size >= 1, got {steps}, {batch_size}")
    directory = Path(model_dir)
    tokenizer = load_tokenizer(directory)
    model = load_model(directory, dtype=torch.float32)
    model.train()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            length = rng.randint(min_digits, max_digits)
            digits = "".join(rng.choice(alphabet) for _ in range(length))
            prompt, completion = warm_prompt(task, digits, rng, ask_share)
            prompt_ids = tokenizer.encode(prompt)
            answer_ids = [*tokenizer.encode(completion, add_special_tokens=False), eos]
            rows.append((prompt_ids, answer_ids))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        logits = model(ids)[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    save_model(model, directory)
    return directory
