"""Tiny random checkpoints of model families the native decoder does not implement, made
locally by transformers from their configs (hidden 32, 2 layers, the project's character
tokenizer), for the transformers path (models/hf_causal.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# family -> (config class, its tiny keyword arguments); ids and vocab come from the tokenizer
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    # sliding window (8) shorter than the runs' sequences, attention and final soft-capping
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    # native: Llama with a window that never binds
    "mistral": ("MistralConfig", {"head_dim": 16, "sliding_window": None}),
}


def make_family(family: str, directory: Path, *, seed: int = 0) -> Path:
    """A random `family` causal LM with the character tokenizer, saved in `directory`."""
    import transformers
    from transformers import AutoModelForCausalLM

    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer

    save_char_tokenizer(directory)
    tokenizer = load_tokenizer(directory)
    config_class, kwargs = TINY[family]
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory
