"""FSDP2 wrapping of a transformers model (models/hf_causal.py): one shard group per decoder
layer (transformers' `_no_split_modules`), then the root, as `parallelize` does for the
native decoder. Parameter names are unchanged; the wrappers' public entry points are
registered with FSDP so that each unshards the root's parameters like `model(...)`."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from pipeline.errors import ConfigError
from pipeline.models.hf_causal import HFModule

_FSDP_METHODS = ("forward_packed", "token_logprobs")


def parallelize_hf(
    model: HFModule,
    mesh: DeviceMesh | None,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> HFModule:
    """Shard `model` in place with fully_shard per decoder layer and at the root."""
    if mesh is not None and mesh.ndim != 1:
        raise ConfigError(f"parallelize_hf expects a 1-D data-parallel mesh, got {mesh.ndim}-D")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.decoder_layers():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for name in _FSDP_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model
