"""Native llama / qwen2 / qwen3 decoders with Hugging Face names, I/O and FSDP2 wrapping."""

from pipeline.models.config import ModelConfig, RopeScaling
from pipeline.models.decoder import CausalLM, DecoderBase
from pipeline.models.hf_io import CheckpointError, load_model, save_model
from pipeline.models.kv_cache import CacheCapacityError, KVCache
from pipeline.models.logprobs import chunked_token_logprobs
from pipeline.models.parallelize import parallelize
from pipeline.models.value_head import ValueModel

__all__ = [
    "CacheCapacityError",
    "CausalLM",
    "CheckpointError",
    "DecoderBase",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "ValueModel",
    "chunked_token_logprobs",
    "load_model",
    "parallelize",
    "save_model",
]
