"""Fused q/k/v and gate/up projections (engines): same logits, same parameters, and weight
updates copied into the parameters reach the fused GEMMs."""

from __future__ import annotations

import copy

import torch

from pipeline.models import ModelConfig
from pipeline.models.fused import fuse_projections


def test_fused_model_keeps_logits_names_and_takes_in_place_updates(
    family_config: ModelConfig, make_native
):
    plain = make_native(family_config)
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    block = fused.model.layers[0]
    assert block.self_attn.qkv_weight is not None and block.mlp.gate_up_weight is not None
    assert block.self_attn.q_proj.weight.data_ptr() == block.self_attn.qkv_weight.data_ptr()
    assert {k: v.shape for k, v in fused.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    ids = torch.randint(
        0, family_config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), plain(ids), atol=1e-5, rtol=1e-5)
        # an engine's weight update: param.copy_ into every parameter, the fused ones too
        gen = torch.Generator().manual_seed(2)
        for model in (plain, fused):
            gen.manual_seed(2)
            for _, param in model.named_parameters():  # tied weights once, same order
                param.copy_(param + 0.05 * torch.randn(param.shape, generator=gen))
        torch.testing.assert_close(fused(ids), plain(ids), atol=1e-5, rtol=1e-5)
