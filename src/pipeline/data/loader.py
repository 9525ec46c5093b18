"""Load prompt datasets in the verl RL schema into `PromptRecord`s.

Schema of a row: `prompt` (text, or chat messages `[{"role", "content"}]`), `data_source`,
`reward_model: {"ground_truth", "style"}`, optional `extra_info`, optional `uid`/`index`,
optional `max_new_tokens` (the row's response budget) and `ignore_eos` (true: its samples
run to that budget, past the end-of-sequence token).
Every problem is reported with the file and row, because a bad row found hours into a run is
far more expensive than one refused at load time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol

from pipeline.data.formats import read_rows
from pipeline.data.records import BadRowError, DataError, PromptRecord
from pipeline.log import get_logger

_log = get_logger("data.loader")


class ChatTemplater(Protocol):
    """What the loader needs from a tokenizer (a transformers tokenizer satisfies it)."""

    def apply_chat_template(self, _conversation: Any, /, **kwargs: Any) -> Any: ...


def _messages(prompt: list[Any], fail: Callable[[str], NoReturn]) -> list[dict[str, str]]:
    if not prompt:
        fail("'prompt' is an empty list of messages")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            fail(f"prompt[{i}] must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            value = message.get(key)
            if not isinstance(value, str):
                fail(f"prompt[{i}].{key} must be a string, got {type(value).__name__}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _ground_truth(row: Mapping[str, Any], fail: Callable[[str], NoReturn]) -> str:
    reward_model = row.get("reward_model")
    if reward_model is None:
        return ""
    if not isinstance(reward_model, Mapping):
        fail(f"'reward_model' must be an object, got {type(reward_model).__name__}")
    truth = reward_model.get("ground_truth", "")
    if truth is None:
        return ""
    if isinstance(truth, bool) or not isinstance(truth, str | int | float):
        fail(f"reward_model.ground_truth must be a string or number, got {type(truth).__name__}")
    return str(truth)


def _uid(row: Mapping[str, Any], extra: Mapping[str, Any], dataset: str, index: int) -> str:
    """Stable across runs and machines: an explicit uid, else the dataset's index, else the row."""
    uid = row.get("uid")
    if isinstance(uid, str | int) and not isinstance(uid, bool):
        return str(uid)
    for key in ("index", "idx"):
        for source in (row, extra):
            value = source.get(key)
            if isinstance(value, str | int) and not isinstance(value, bool):
                return f"{dataset}:{value}"
    return f"{dataset}:{index}"


def parse_row(row: Any, *, path: str, index: int, dataset_name: str) -> PromptRecord:
    """One schema row as a `PromptRecord` (no chat template applied yet)."""

    def fail(problem: str) -> NoReturn:
        raise BadRowError(path, index, problem)

    if not isinstance(row, Mapping):
        fail(f"expected an object, got {type(row).__name__}")
    prompt = row.get("prompt")
    messages: list[dict[str, str]] | None = None
    if prompt is None:
        fail("missing 'prompt' (text, or a list of {role, content} messages)")
    elif isinstance(prompt, str):
        if not prompt.strip():
            fail("'prompt' is empty")
        text = prompt
    elif isinstance(prompt, list):
        messages = _messages(prompt, fail)
        # Without a template, the raw prompt is the turns' text; roles need a template.
        text = "\n\n".join(m["content"] for m in messages)
    else:
        fail(f"'prompt' must be text or a list of messages, got {type(prompt).__name__}")
    data_source = row.get("data_source", dataset_name)
    if not isinstance(data_source, str):
        fail(f"'data_source' must be a string, got {type(data_source).__name__}")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, Mapping):
        fail(f"'extra_info' must be an object, got {type(extra).__name__}")
    budget = row.get("max_new_tokens")
    if budget is None:
        budget = 0
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        fail(f"'max_new_tokens' must be a whole number of tokens >= 1, got {budget!r}")
    ignore_eos = row.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        fail(f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    return PromptRecord(
        uid=_uid(row, extra, dataset_name, index),
        prompt_text=text,
        messages=messages,
        data_source=data_source,
        ground_truth=_ground_truth(row, fail),
        extra_info=dict(extra),
        max_new_tokens=budget,
        ignore_eos=ignore_eos,
    )


def _load_tokenizer(tokenizer: ChatTemplater | str | Path) -> ChatTemplater:
    if isinstance(tokenizer, str | Path):
        from pipeline.data.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer)
    return tokenizer


def apply_chat_template(
    record: PromptRecord, tokenizer: ChatTemplater, *, add_generation_prompt: bool = True
) -> PromptRecord:
    """The record with `prompt_text` rendered by the tokenizer's chat template (chat rows only)."""
    if record.messages is None:
        return record
    try:
        text = tokenizer.apply_chat_template(
            record.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:
        raise DataError(f"chat template failed for prompt {record.uid!r}: {exc}") from exc
    if not isinstance(text, str):
        raise DataError(f"chat template returned {type(text).__name__} for {record.uid!r}")
    return PromptRecord(
        uid=record.uid,
        prompt_text=text,
        messages=record.messages,
        data_source=record.data_source,
        ground_truth=record.ground_truth,
        extra_info=record.extra_info,
        max_new_tokens=record.max_new_tokens,
        ignore_eos=record.ignore_eos,
    )


def load_prompts(
    path: str | Path,
    *,
    dataset_name: str | None = None,
    tokenizer: ChatTemplater | str | Path | None = None,
    add_generation_prompt: bool = True,
) -> list[PromptRecord]:
    """Every row of a `.parquet`/`.jsonl`/`.json` file as a `PromptRecord`.

    `dataset_name` (default: the file stem) prefixes generated uids and is the default
    `data_source`. `tokenizer` (an object, or a local tokenizer directory) renders chat prompts.
    """
    path = Path(path)
    name = dataset_name or path.stem
    rows = read_rows(path)
    records = [
        parse_row(row, path=str(path), index=i, dataset_name=name) for i, row in enumerate(rows)
    ]
    seen: dict[str, int] = {}
    for i, record in enumerate(records):
        if record.uid in seen:
            raise BadRowError(
                str(path),
                i,
                f"uid {record.uid!r} repeats row {seen[record.uid]}; uids must be unique",
            )
        seen[record.uid] = i
    if tokenizer is not None:
        templater = _load_tokenizer(tokenizer)
        records = [
            apply_chat_template(r, templater, add_generation_prompt=add_generation_prompt)
            for r in records
        ]
    _log.info("prompts loaded", path=str(path), rows=len(records), dataset=name)
    return records
