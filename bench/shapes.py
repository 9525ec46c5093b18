"""Model shapes of the standard benchmarks (docs/performance.md): random weights, real sizes."""

from __future__ import annotations

from pipeline.models import ModelConfig

SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        model_type="qwen2",
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
    "0.5b": ModelConfig(  # Qwen2.5-0.5B
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
    "7b": ModelConfig(  # Qwen2.5-7B
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
}
