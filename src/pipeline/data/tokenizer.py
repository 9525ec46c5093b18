"""A tiny character-level tokenizer saved in Hugging Face format.

The toy task's policy is a small transformer trained from scratch, so a character vocabulary
(about a hundred tokens) keeps its embedding and output layers tiny and makes every digit one
token, which is what the reversal task needs. transformers' `save_pretrained` writes it
(`tokenizer.json`, `tokenizer_config.json` and the chat template), so `AutoTokenizer` and
inference engines load it like any other model's tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pipeline.data.records import DataError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)
# "`" last, so every other id stays put: without it a ```python block (the gsm8k_python
# tool's call) encodes to <unk>s and the policy could never call that tool; 93 tokens still
# round up to the tiny model's 96-row embedding, which is unchanged
CHARACTERS = (
    string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n.,:;!?+-*/=()<>#$%'\"_`"
)

# Roles as single tokens; the text of a turn ends with <eos>, which is also where generation
# stops. No <bos> here: the post-processor adds it when the rendered text is tokenized.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer(characters: str = CHARACTERS) -> Tokenizer:
    """One token per character (unknown characters -> `<unk>`), `<bos>` prepended on encode."""
    chars = list(dict.fromkeys(characters))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


def save_char_tokenizer(
    out_dir: str | Path, *, characters: str = CHARACTERS, model_max_length: int = 512
) -> Path:
    """Write the tokenizer in Hugging Face format into `out_dir`; returns the directory.
    The files are the installed transformers' own: transformers 5 names its
    `TokenizersBackend` in them, which transformers 4 cannot load."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_char_tokenizer(characters),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tok.save_pretrained(str(out))
    return out


def load_tokenizer(path: str | Path) -> Any:
    """`transformers.AutoTokenizer` from a local directory; never touches the network."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise DataError(f"{path}: no tokenizer.json or tokenizer_config.json in this directory")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DataError("loading a tokenizer needs transformers: pip install transformers") from exc
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise DataError(f"{path}: cannot load tokenizer: {exc}") from exc
