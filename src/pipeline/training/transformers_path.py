"""A trainer over transformers' modeling (models/hf_causal.py): its settings and placement.

The native decoder's kernels and compiled paths (packing, fused norms and RoPE, trunk CUDA
graphs, compiled blocks, tied-gradient rows, the flat optimizer over grouped rows) do not
apply to a transformers model: `for_transformers` turns them off, so micro-batches are
padded (transformers' forward takes padded rows for every architecture) and the update is
the plain AdamW. The losses are the same code as the native path's.
"""

from __future__ import annotations

import dataclasses

import torch

from pipeline.models.hf_causal import HFModule
from pipeline.training.config import TrainerConfig
from pipeline.training.distributed import DistInfo, build_mesh, is_distributed


def for_transformers(config: TrainerConfig) -> TrainerConfig:
    """`config` without the native decoder's kernels and compiled paths."""
    return dataclasses.replace(
        config,
        padding_free=False,
        pack_bucket_tokens=0,
        compile=False,
        trunk_graphs=False,
        fused_rope=False,
        fused_norm=False,
        packed_mlp=False,
        uniform_attention=False,
        tied_grad_rows=False,
        logprob_keep_logits=False,
        flat_optimizer=False,
    )


def place_hf_model(
    model: HFModule, config: TrainerConfig, info: DistInfo, *, trainable: bool
) -> HFModule:
    """`place_model` for a transformers model: float32 masters (a frozen model in one process
    in the compute dtype), eval mode (no dropout: the no-grad and the trained forwards are
    the same function), per-layer activation checkpointing, FSDP2 per decoder layer."""
    from pipeline.models.hf_parallelize import parallelize_hf

    single_dtype = torch.float32
    if not trainable and not is_distributed():
        single_dtype = config.compute_dtype(info.device)
    model = model.to(device=info.device, dtype=single_dtype)
    model.eval()
    if config.activation_checkpointing and trainable:
        model.hf.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        for layer in model.decoder_layers():
            layer.training = True  # transformers checkpoints a layer in training mode only
    if is_distributed():
        parallelize_hf(
            model,
            build_mesh(info),
            param_dtype=config.compute_dtype(info.device),
            reduce_dtype=config.reduce_torch_dtype,
        )
    return model
