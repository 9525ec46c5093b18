"""The default task's policy: a tiny Qwen2-family decoder made locally with random weights.

It is saved in the Hugging Face layout (config.json + safetensors + tokenizer), so it goes
through exactly the local-directory path a real model uses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.models import CausalLM, ModelConfig, save_model


def tiny_config(vocab_size: int, *, hidden: int = 64, layers: int = 2) -> ModelConfig:
    # round the vocabulary up so the embedding matrix has a friendly shape
    vocab = (vocab_size + 31) // 32 * 32
    return ModelConfig(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=True,
    )


def make_tiny_model(
    directory: str | Path,
    *,
    vocab_size: int,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    warm_start_steps: int = 0,
    warm_start_task: str = "copy",
) -> Path:
    """Write a freshly initialised tiny model next to the tokenizer in `directory`.

    `warm_start_steps` > 0 then trains it that many supervised steps on copying digits (see
    `pipeline.tasks.warm_start`; needs the tokenizer already saved in `directory`). The default
    toy-task recipe uses 200.
    """
    torch.manual_seed(seed)
    model = CausalLM(tiny_config(vocab_size, hidden=hidden, layers=layers))
    model.init_weights()
    save_model(model, directory)
    if warm_start_steps > 0:
        from pipeline.tasks.warm_start import warm_start

        warm_start(directory, steps=warm_start_steps, seed=seed, task=warm_start_task)
    return Path(directory)
