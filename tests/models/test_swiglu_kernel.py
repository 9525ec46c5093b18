"""The one-pass SwiGLU op (models/swiglu_kernel.py) against silu(gate) * up in float64,
forward and backward: its torch formula here, its Triton kernel under the interpreter on CPU
and compiled on a GPU; and a model with `packed` MLPs against one without."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.swiglu_kernel import swiglu_packed

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
import torch.nn.functional as F
from pipeline.models.swiglu_kernel import kernel_supported, swiglu_packed

g = torch.Generator().manual_seed(0)
for lead, cols in (((45,), 300), ((2, 9), 40), ((0,), 16)):  # ragged blocks, 3-d, empty
    x = (2 * torch.randn(*lead, 2 * cols, generator=g)).to(DEVICE, DTYPE)
    assert kernel_supported(x) == KERNEL
    dh = torch.randn(*lead, cols, generator=g).to(DEVICE, DTYPE)
    outs = []
    for fused in (True, False):
        xx = x.clone().requires_grad_() if fused else x.double().requires_grad_()
        if fused:
            out = swiglu_packed(xx)
        else:
            gate, up = xx.chunk(2, dim=-1)
            out = F.silu(gate) * up
        out.backward(dh.to(xx.dtype))
        outs.append([out.detach().double().cpu(), xx.grad.double().cpu()])
    for name, a, b in zip(("h", "d gu"), *outs):
        assert a.shape == b.shape, name
        if a.numel():
            err = ((a - b).abs() / (1 + b.abs())).max().item()
            assert err < ATOL, (name, lead, cols, err)

# compiled: one opaque op inside the graph, the same values
x = torch.randn(33, 64, generator=g).to(DEVICE, DTYPE)
f = torch.compile(lambda a: swiglu_packed(a).sum(), fullgraph=True)
torch.testing.assert_close(f(x), swiglu_packed(x).sum())
"""
    + model_parity(
        "packed gate|up GEMM and swiglu_packed in every MLP",
        2,
        "    for block in model.model.layers:\n        block.mlp.packed = fused",
    )
    + """
print("swiglu ok")
"""
)


def test_torch_formula_matches_float64_where_triton_does_not_run():
    check_formula_on_cpu(CHECK)


@needs_triton
def test_kernel_matches_float64_under_the_triton_interpreter():
    assert "swiglu ok" in check_interpreted(CHECK)


@pytest.mark.gpu
@needs_cuda
def test_kernel_matches_float64_in_bf16_on_cuda():
    # outputs rounded once to bf16 (<= 2^-9 relative) against the formula in float64 on the
    # same bf16 inputs
    assert "swiglu ok" in check_cuda_bf16(CHECK)


def test_an_odd_width_is_refused():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu_packed(torch.zeros(3, 5))
