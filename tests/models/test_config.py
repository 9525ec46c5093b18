"""ModelConfig <-> HF config.json, and validation messages."""

from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.models import ModelConfig, RopeScaling

from .conftest import FAMILY_CONFIGS


def test_hf_dict_round_trip_and_transformers_accepts_it(family_config: ModelConfig):
    import transformers

    hf_dict = family_config.to_hf_dict()
    assert ModelConfig.from_hf_dict(hf_dict) == family_config
    hf = transformers.AutoConfig.for_model(**hf_dict)
    assert ModelConfig.from_hf_dict(hf.to_dict()) == family_config
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family_config.model_type]
    assert hf_dict["architectures"] == [f"{prefix}ForCausalLM"]


def test_from_hf_dict_reads_transformers4_layout_and_keeps_extra_keys():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
    }
    config = ModelConfig.from_hf_dict(raw)
    assert config.head_dim == 8  # hidden_size // num_attention_heads when absent
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.torch_dtype == "bfloat16"
    assert config.to_hf_dict()["eos_token_id"] == [2, 3]


def test_qwen2_hf_dict_implies_qkv_bias_and_qwen3_implies_qk_norm():
    base = {k: v for k, v in FAMILY_CONFIGS["llama"].to_hf_dict().items() if k != "attention_bias"}
    qwen2 = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "architectures": None})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf_dict({**base, "model_type": "qwen3"})
    assert qwen3.qk_norm and not qwen3.attention_bias


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gemma"}, "model_type='gemma' is not supported"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"torch_dtype": "float64"}, "torch_dtype='float64' is not supported"),
        ({"qk_norm": True}, "qk_norm=True does not match model_type='llama'"),
        ({"head_dim": 7}, "head_dim must be even"),
    ],
)
def test_invalid_config_raises_config_error_naming_the_field(changes: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        FAMILY_CONFIGS["llama"].replace(**changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "needs low_freq_factor"),
        ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"model_type": "gemma"}, "model_type='gemma' is not supported"),
        ({"model_type": "qwen2", "num_attention_heads": 2}, "qwen2 requires head_dim"),
        ({"model_type": "mistral", "sliding_window": 2}, "sliding_window=2 is shorter"),
    ],
)
def test_unsupported_hf_features_raise_config_error(changes: dict, message: str):
    raw = {**FAMILY_CONFIGS["llama"].to_hf_dict(), "rope_parameters": None, **changes}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(raw)
