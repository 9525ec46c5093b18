from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pipeline.data.records import DataError
from pipeline.data.tokenizer import (
    BOS,
    CHARACTERS,
    EOS,
    PAD,
    build_char_tokenizer,
    load_tokenizer,
)


def test_files_in_hugging_face_format(char_tokenizer_dir):
    names = {p.name for p in char_tokenizer_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    config = json.loads((char_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" in config


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
