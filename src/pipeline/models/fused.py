"""Fused projections for inference: q/k/v and gate/up as one GEMM each.

A decode step of a small model is a long chain of small GEMMs; merging the three attention
input projections and the two MLP input projections removes 3 of every 7 per layer. The
parameters keep their names and shapes: each becomes a view into one concatenated tensor, so
`param.copy_` (how engines take weight updates) and `state_dict` work unchanged. Meant for
engines only: a trainer's optimizer or FSDP would replace the views.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.attention import Attention
from pipeline.models.layers import SwiGLU


def _concat_as_views(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding `params` end to end along dim 0; each parameter becomes a view."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


@torch.no_grad()
def fuse_projections(model: nn.Module) -> None:
    """Make every attention and MLP block of `model` run its input projections fused."""
    for module in model.modules():
        if isinstance(module, Attention) and module.qkv_weight is None:
            projs = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_weight = _concat_as_views([m.weight for m in projs])
            if all(m.bias is not None for m in projs):
                module.qkv_bias = _concat_as_views([m.bias for m in projs])
            elif any(m.bias is not None for m in projs):  # mixed: keep them apart
                module.qkv_weight = None
        elif isinstance(module, SwiGLU) and module.gate_up_weight is None:
            module.gate_up_weight = _concat_as_views(
                [module.gate_proj.weight, module.up_proj.weight]
            )
