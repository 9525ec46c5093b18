from __future__ import annotations

import json

import pytest

from pipeline.data.formats import read_rows, write_rows
from pipeline.data.loader import load_prompts
from pipeline.data.records import BadRowError, DataError, PromptRecord

TEXT_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": "What is 2 + 3?",
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {"split": "test", "index": 10},
}
CHAT_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 4 * 4?"},
    ],
    "reward_model": {"style": "rule", "ground_truth": "16"},
    "extra_info": {"split": "test", "index": 11},
}
CHAT_TEXT = "<|system|>Be brief.<eos><|user|>What is 4 * 4?<eos><|assistant|>"


@pytest.fixture(params=["jsonl", "parquet"])
def datasets(request, tmp_path):
    """A text-prompt file and a chat-prompt file (parquet columns cannot mix the two)."""
    fmt = request.param
    return (
        write_rows([TEXT_ROW], tmp_path / f"text.{fmt}"),
        write_rows([CHAT_ROW], tmp_path / f"chat.{fmt}"),
    )


def test_text_and_chat_prompts_load(datasets):
    text_path, chat_path = datasets
    (text,) = load_prompts(text_path, dataset_name="mini")
    (chat,) = load_prompts(chat_path, dataset_name="mini")
    assert text == PromptRecord(
        uid="mini:10",
        prompt_text="What is 2 + 3?",
        messages=None,
        data_source="openai/gsm8k",
        ground_truth="5",
        extra_info={"split": "test", "index": 10},
    )
    assert chat.uid == "mini:11"
    assert chat.messages == CHAT_ROW["prompt"]
    assert chat.prompt_text == "Be brief.\n\nWhat is 4 * 4?"  # no template: the turns' text
    assert chat.ground_truth == "16"


def test_chat_template_from_a_tokenizer_directory(datasets, char_tokenizer_dir, char_tokenizer):
    text_path, chat_path = datasets
    (text,) = load_prompts(text_path, tokenizer=char_tokenizer)
    (chat,) = load_prompts(chat_path, tokenizer=char_tokenizer)
    assert text.prompt_text == "What is 2 + 3?"  # text prompts are used as written
    assert chat.prompt_text == CHAT_TEXT
    (by_dir,) = load_prompts(chat_path, tokenizer=char_tokenizer_dir)
    assert by_dir.prompt_text == CHAT_TEXT


def test_jsonl_may_mix_prompt_kinds_and_numeric_truths(tmp_path):
    numeric = {**CHAT_ROW, "reward_model": {"ground_truth": 16}}
    text, chat = load_prompts(write_rows([TEXT_ROW, numeric], tmp_path / "mixed.jsonl"))
    assert (text.messages, chat.ground_truth) == (None, "16")
    with pytest.raises(DataError, match="cannot be stored as parquet"):
        write_rows([TEXT_ROW, CHAT_ROW], tmp_path / "mixed.parquet")


def test_uids_are_stable_and_fall_back_to_row_index(tmp_path):
    rows = [{"prompt": "a", "uid": "custom-7"}, {"prompt": "b", "index": 3}, {"prompt": "c"}]
    path = write_rows(rows, tmp_path / "u.jsonl")
    records = load_prompts(path)
    assert [r.uid for r in records] == ["custom-7", "u:3", "u:2"]
    assert [r.data_source for r in records] == ["u"] * 3  # defaults to the dataset name
    assert load_prompts(path) == records


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"data_source": "x"}, "row 1: missing 'prompt'"),
        ({"prompt": 5}, "row 1: 'prompt' must be text or a list of messages, got int"),
        ({"prompt": "  "}, "row 1: 'prompt' is empty"),
        ({"prompt": []}, "row 1: 'prompt' is an empty list"),
        ({"prompt": ["hi"]}, r"row 1: prompt\[0\] must be an object"),
        (
            {"prompt": [{"role": "user"}]},
            r"row 1: prompt\[0\].content must be a string, got NoneType",
        ),
        ({"prompt": [{"role": "user", "content": 3}]}, r"prompt\[0\].content must be a string"),
        ({"prompt": "q", "data_source": 1}, "'data_source' must be a string, got int"),
        ({"prompt": "q", "reward_model": "5"}, "'reward_model' must be an object"),
        ({"prompt": "q", "reward_model": {"ground_truth": [1]}}, "ground_truth must be a string"),
        ({"prompt": "q", "extra_info": [1]}, "'extra_info' must be an object"),
        ([1, 2], "row 1: expected an object, got list"),
        ({"prompt": "q", "uid": "a"}, "row 1: uid 'a' repeats row 0"),
    ],
)
def test_bad_rows_name_file_row_and_problem(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "uid": "a"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(BadRowError, match=message) as info:
        load_prompts(path)
    assert str(path) in str(info.value)
    assert info.value.row == 1


def test_bad_rows_in_parquet_are_reported_too(tmp_path):
    path = write_rows([{"prompt": "ok"}, {"prompt": None}], tmp_path / "bad.parquet")
    with pytest.raises(BadRowError, match=r"bad.parquet: row 1: missing 'prompt'"):
        load_prompts(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"unknown dataset format '\.csv'"):
        load_prompts(tmp_path / "data.csv")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(BadRowError, match="line 3 is not valid JSON"):
        read_rows(broken)
    with pytest.raises(DataError, match="template failed"):
        load_prompts(write_rows([CHAT_ROW], tmp_path / "ok.jsonl"), tokenizer=_NoTemplate())


class _NoTemplate:
    def apply_chat_template(self, conversation, **kwargs):
        raise ValueError("no chat template is set")


def test_real_gsm8k_converted_and_loaded(gsm8k_test_rows, tmp_path):
    from pipeline.data.gsm8k import convert_gsm8k
    from pipeline.rewards.gsm8k import compute_score

    path = write_rows(convert_gsm8k(gsm8k_test_rows, "test"), tmp_path / "gsm8k_test.parquet")
    records = load_prompts(path, dataset_name="gsm8k/test")
    assert len(records) == 1319
    assert len({r.uid for r in records}) == 1319
    assert records[0].uid == "gsm8k/test:0"
    assert records[0].ground_truth == "18"
    assert all(compute_score(r.extra_info["answer"], r.ground_truth) == 1.0 for r in records)
