"""Packed sequences on CUDA go through flash varlen attention: same logits and gradients as
running each sequence alone (dense causal), in bf16, with tail padding in the pack."""

from __future__ import annotations

import pytest
import torch

from pipeline.bench.shapes import SHAPES
from pipeline.models import CausalLM

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_packed_varlen_equals_each_sequence_alone():
    torch.manual_seed(0)
    config = SHAPES["tiny"].replace(num_hidden_layers=2)
    with torch.device("cuda"):
        model = CausalLM(config)
    model.init_weights()
    model.to(torch.bfloat16)
    lengths = [5, 37, 12, 64]
    seqs = [torch.randint(1, config.vocab_size, (n,), device="cuda") for n in lengths]
    pad = 7  # tail padding after the last sequence
    ids = torch.cat([*seqs, torch.zeros(pad, dtype=torch.long, device="cuda")])[None]
    pos = torch.cat([torch.arange(n, device="cuda") for n in [*lengths, pad]])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    packed = model.forward_packed(ids, pos, cu)  # (1, total, vocab)
    start = 0
    for seq in seqs:
        alone = model(seq[None])  # (1, n, vocab), plain causal SDPA
        got = packed[0, start : start + len(seq)]
        torch.testing.assert_close(got.float(), alone[0].float(), atol=3e-2, rtol=3e-2)
        start += len(seq)
    # gradients flow through the varlen kernel like through dense attention
    weight = torch.randn_like(packed[0, : sum(lengths)].float())
    (packed[0, : sum(lengths)].float() * weight).sum().backward()
    packed_grad = model.model.layers[0].self_attn.q_proj.weight.grad.float().clone()
    model.zero_grad()
    start, total = 0, 0.0
    for seq in seqs:
        alone = model(seq[None])[0].float()
        total = total + (alone * weight[start : start + len(seq)]).sum()
        start += len(seq)
    total.backward()
    dense_grad = model.model.layers[0].self_attn.q_proj.weight.grad.float()
    cos = torch.nn.functional.cosine_similarity(packed_grad.flatten(), dense_grad.flatten(), 0)
    assert cos > 0.99, f"packed vs dense q_proj gradient cosine {cos:.4f}"
