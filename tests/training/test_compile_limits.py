"""Sizes that are equal at a compiled function's first call get symbols of their own
(no "duck sizing"): the rollout engine's first prefill had 64 prompt tokens, as many as
the model's head_dim, and each later prompt length compiled its blocks again."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.utils import counters

from pipeline.models.attention import AttentionSpec
from pipeline.models.decoder import DecoderBlock
from pipeline.models.layers import RotaryEmbedding
from pipeline.training.compile_limits import allow_recompiles

from ._helpers import TINY


def test_a_length_equal_to_head_dim_at_the_first_call_compiles_once():
    allow_recompiles()
    config = dataclasses.replace(TINY, num_hidden_layers=1)
    head_dim = config.head_dim
    block = DecoderBlock(config, 0).eval()
    block.compile(dynamic=True, backend="eager")
    rope = RotaryEmbedding(config)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for batch, seq in ((2, head_dim), (2, head_dim - 3), (3, 5)):
            x = torch.randn(batch, seq, config.hidden_size)
            cos, sin = rope(torch.arange(seq).expand(batch, seq), x.dtype)
            block(x, cos, sin, AttentionSpec())
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
