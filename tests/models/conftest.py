"""Tiny configs of every supported family and HF twins with identical random weights."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pipeline.models import CausalLM, ModelConfig, RopeScaling

_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)

FAMILY_CONFIGS: dict[str, ModelConfig] = {
    "llama": ModelConfig(model_type="llama", **_BASE),
    "llama_rope_llama3": ModelConfig(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        **_BASE,
    ),
    "qwen2_bias_tied": ModelConfig(
        model_type="qwen2", attention_bias=True, tie_word_embeddings=True, **_BASE
    ),
    "qwen3_qknorm_untied": ModelConfig(
        model_type="qwen3", qk_norm=True, tie_word_embeddings=False, **{**_BASE, "head_dim": 16}
    ),
}


@pytest.fixture(params=sorted(FAMILY_CONFIGS))
def family_config(request: pytest.FixtureRequest) -> ModelConfig:
    return FAMILY_CONFIGS[request.param]


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that logits are O(1) and attention is far from uniform (HF's
    0.02 init gives near-constant logits, which would hide numeric mismatches)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


@pytest.fixture
def randomize() -> Callable[..., None]:
    return randomize_


@pytest.fixture
def make_native() -> Callable[[ModelConfig], CausalLM]:
    def make(config: ModelConfig, seed: int = 0) -> CausalLM:
        model = CausalLM(config).eval()
        randomize_(model, seed)
        return model

    return make


@pytest.fixture
def make_hf_twin() -> Callable[[ModelConfig], tuple[torch.nn.Module, CausalLM]]:
    """(transformers model, native model) sharing weights copied by name with no renaming."""

    def make(config: ModelConfig, seed: int = 0) -> tuple[torch.nn.Module, CausalLM]:
        import transformers

        hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
        hf_config._attn_implementation = "sdpa"
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        hf.eval()
        randomize_(hf, seed)
        native = CausalLM(config).eval()
        native.load_state_dict(hf.state_dict(), strict=True)
        return hf, native

    return make
