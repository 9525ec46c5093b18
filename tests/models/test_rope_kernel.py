"""The one-pass RoPE op (models/rope_kernel.py) against `layers.apply_rope` in float64,
forward and backward: its torch formula here, its Triton kernel under the interpreter on CPU
and compiled on a GPU; and a model with `fused_rope` against one without."""

from __future__ import annotations

import pytest

from .triton_helpers import (
    check_cuda_bf16,
    check_formula_on_cpu,
    check_interpreted,
    model_parity,
    needs_cuda,
    needs_triton,
)

CHECK = (
    """
import torch
from pipeline.models.layers import apply_rope
from pipeline.models.rope_kernel import kernel_supported, rope_qkv

def reference(qkv, cos, sin, heads, kv, hd):
    t = cos.shape[0]
    q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], -1)
    q = apply_rope(q.reshape(1, t, heads, hd), cos[None], sin[None])[0]
    k = apply_rope(k.reshape(1, t, kv, hd), cos[None], sin[None])[0]
    return q, k, v.reshape(t, kv, hd)

g = torch.Generator().manual_seed(0)
for t, heads, kv, hd in ((45, 4, 2, 16), (70, 3, 1, 32)):  # ragged token blocks
    x = torch.randn(t, (heads + 2 * kv) * hd, generator=g).to(DEVICE, DTYPE)
    ang = torch.arange(t)[:, None] * torch.rand(hd // 2, generator=g)[None]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(DEVICE, DTYPE), ang.sin().to(DEVICE, DTYPE)
    assert kernel_supported(x, hd) == KERNEL
    grads = [torch.randn(t, n, hd, generator=g).to(DEVICE, DTYPE) for n in (heads, kv, kv)]
    outs = []
    for fused in (True, False):
        xx = x.clone().requires_grad_() if fused else x.double().requires_grad_()
        if fused:
            out = rope_qkv(xx, cos, sin, heads, kv)
        else:
            out = reference(xx, cos.double(), sin.double(), heads, kv, hd)
        torch.autograd.backward(out, [gr.to(xx.dtype) for gr in grads])
        outs.append([o.detach().double().cpu() for o in out] + [xx.grad.double().cpu()])
    for name, a, b in zip(("q", "k", "v", "d qkv"), *outs):
        assert a.shape == b.shape, name
        err = (a - b).abs().max().item()
        assert err < ATOL, (name, t, err)
    q, k, v = rope_qkv(x, cos, sin, heads, kv)
    assert all(o.is_contiguous() for o in (q, k, v))

# compiled: one opaque op inside the graph, the same values
f = torch.compile(lambda a, c, s: [o.sum() for o in rope_qkv(a, c, s, heads, kv)], fullgraph=True)
torch.testing.assert_close(f(x, cos, sin), [o.sum() for o in rope_qkv(x, cos, sin, heads, kv)])
"""
    + model_parity(
        "fused_rope on every attention layer",
        2,
        "    for block in model.model.layers:\n        block.self_attn.fused_rope = fused",
    )
    + """
print("rope ok")
"""
)


def test_torch_formula_matches_float64_where_triton_does_not_run():
    check_formula_on_cpu(CHECK)


@needs_triton
def test_kernel_matches_float64_under_the_triton_interpreter():
    assert "rope ok" in check_interpreted(CHECK)


@pytest.mark.gpu
@needs_cuda
def test_kernel_matches_float64_in_bf16_on_cuda():
    # outputs rounded once to bf16 (<= 2^-9 relative) against the formula in float64 on the
    # same bf16 inputs; the model's bf16 GEMMs see inputs differing by such roundings
    assert "rope ok" in check_cuda_bf16(CHECK)
