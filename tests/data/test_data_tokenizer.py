from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pipeline.data.records import DataError
from pipeline.data.tokenizer import (
    BOS,
    CHARACTERS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    build_char_tokenizer,
    load_tokenizer,
    save_char_tokenizer,
)


def test_files_are_what_transformers_writes_and_stable(char_tokenizer_dir, tmp_path):
    names = {p.name for p in char_tokenizer_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    saved = json.loads((char_tokenizer_dir / "tokenizer.json").read_text())
    assert saved == json.loads(build_char_tokenizer().to_str())
    again = save_char_tokenizer(tmp_path)
    assert {p.name for p in again.iterdir()} == names
    for name in names:
        assert (again / name).read_bytes() == (char_tokenizer_dir / name).read_bytes(), name


def test_auto_tokenizer_loads_the_directory_and_round_trips(char_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(char_tokenizer_dir), local_files_only=True)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.model_max_length == 512 and tok.padding_side == "left"
    assert set(SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    text = CHARACTERS + "reverse 3917 = 7193"
    ids = tok(text)["input_ids"]
    assert ids == build_char_tokenizer().encode(text).ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_loads_a_directory_in_an_older_transformers_format(tmp_path):
    """A user's tokenizer directory as transformers 4 wrote it (special_tokens_map.json,
    the chat template inside tokenizer_config.json)."""
    build_char_tokenizer().save(str(tmp_path / "tokenizer.json"))
    special = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **special}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special))
    tok = load_tokenizer(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    messages = [{"role": "user", "content": "reverse 12 ="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>reverse 12 =<eos><|assistant|>"
    assert tok.decode(tok("905")["input_ids"], skip_special_tokens=True) == "905"


def test_round_trip_one_token_per_character():
    tok = build_char_tokenizer()
    text = "reverse 3917 = 7193\nHello, World! $5 #### 18"
    encoding = tok.encode(text)
    assert encoding.tokens[0] == BOS
    assert len(encoding.ids) == len(text) + 1
    assert tok.decode(encoding.ids) == text
    assert tok.get_vocab_size() == 7 + len(CHARACTERS)


def test_loads_through_auto_tokenizer(char_tokenizer_dir, char_tokenizer):
    tok = char_tokenizer
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "reverse 905 = 509"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("é")["input_ids"], skip_special_tokens=False) == f"{BOS}<unk>"
    direct = AutoTokenizer.from_pretrained(str(char_tokenizer_dir), local_files_only=True)
    assert direct("abc")["input_ids"] == tok("abc")["input_ids"]


def test_chat_template_uses_role_tokens(char_tokenizer):
    messages = [{"role": "user", "content": "reverse 12 ="}]
    text = char_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>reverse 12 =<eos><|assistant|>"
    tokens = char_tokenizer.convert_ids_to_tokens(char_tokenizer(text)["input_ids"])
    assert tokens[:2] == [BOS, "<|user|>"] and tokens[-1] == "<|assistant|>"


def test_load_tokenizer_refuses_an_empty_directory(tmp_path):
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
