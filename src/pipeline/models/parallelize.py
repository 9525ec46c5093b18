"""FSDP2 wrapping of a native decoder: one shard group per block, then the root.

Parameter names are unchanged (no wrapper modules): activation checkpointing is a flag the
block honours inside its own forward, and compilation uses `Module.compile`, which compiles
in place. The public non-`forward` entry points are registered with FSDP so that calling,
e.g., `model.token_logprobs(...)` unshards the root parameters exactly like `model(...)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from pipeline.errors import ConfigError
from pipeline.models.decoder import DecoderBase, DecoderBlock

FSDP_METHODS = (
    "hidden_states",
    "forward_packed",
    "hidden_states_packed",
    "token_logprobs",
    "forward_cached",
)


def parallelize(
    model: DecoderBase,
    mesh: DeviceMesh | None,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    compile_kwargs: Mapping[str, Any] | None = None,
    reshard_after_forward: bool = True,
) -> DecoderBase:
    """Shard `model` in place with fully_shard and return it.

    mesh None lets FSDP build a 1-D mesh over the default process group. Blocks reshard
    after forward (ZeRO-3); the root does not, since its parameters (embeddings, lm_head)
    are needed again right at the start of backward. `compile_kwargs`: each block is
    compiled with these (`Module.compile`'s keywords), None: not compiled.
    """
    if mesh is not None and mesh.ndim != 1:
        raise ConfigError(f"parallelize expects a 1-D data-parallel mesh, got {mesh.ndim}-D")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = model.model.layers
    for block in cast(Iterable[DecoderBlock], layers):
        block.activation_checkpointing = activation_checkpointing
        if compile_kwargs is not None:
            block.compile(**compile_kwargs)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for name in FSDP_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model
