"""One constructor for every backend, so services and benchmarks choose by a config string."""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

from pipeline.engines.base import Engine
from pipeline.errors import ConfigError

EngineKind = Literal["torch", "hf", "vllm"]


def make_engine(
    kind: EngineKind,
    model_path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_batch: int = 32,
    max_seq_len: int = 2048,
    seed: int = 0,
    **options: Any,
) -> Engine:
    """Build an engine over a local HF checkpoint directory.

    `options` go to the backend's config: TorchEngineConfig (max_prefill_tokens,
    kv_on_update, use_cuda_graphs, compile, overlap,
    decode_kernel, sample_kernel, shared_prefill; `tp`, a TPGroup, makes it this rank's TPEngine), HFEngineConfig (static_cache, compile,
    attn_implementation) or VLLMEngineConfig (gpu_memory_utilization, enforce_eager,
    enable_prefix_caching, tensor_parallel_size, llm_kwargs). Backends are imported on
    demand so that choosing one never needs the others' packages.
    """
    if kind == "torch":
        from pipeline.engines.torch_engine import TorchEngine, TorchEngineConfig

        tp = options.pop("tp", None)
        config = TorchEngineConfig(
            max_batch=max_batch, max_seq_len=max_seq_len, seed=seed, **options
        )
        if tp is None or tp.size == 1:
            return TorchEngine.from_pretrained(
                model_path, device=device, dtype=dtype, config=config
            )
        from pipeline.engines.tp_engine import TPEngine
        from pipeline.models import CausalLM, load_model
        from pipeline.models.tensor_parallel import shard_model

        model = load_model(model_path, dtype=dtype, device=device)
        assert isinstance(model, CausalLM)
        shard_model(model, tp)  # before the engine fuses projections and sizes its cache
        return TPEngine(TorchEngine(model, config), rank=tp.rank, control=tp.control)
    if kind == "hf":
        from pipeline.engines.hf_engine import HFEngine, HFEngineConfig

        # transformers' dynamic cache needs no max_seq_len
        hf_config = HFEngineConfig(max_batch=max_batch, seed=seed, **options)
        return HFEngine(model_path, device=device, dtype=dtype, config=hf_config)
    if kind == "vllm":
        from pipeline.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        if torch.device(device).type not in ("cpu", "cuda"):
            raise ConfigError(f"vllm engine runs on cpu or cuda, not {device}")
        vllm_config = VLLMEngineConfig(
            max_batch=max_batch, max_seq_len=max_seq_len, seed=seed, **options
        )
        return VLLMEngine(model_path, dtype=dtype, config=vllm_config)
    raise ConfigError(f"engine kind {kind!r} is unknown; use 'torch', 'hf' or 'vllm'")
