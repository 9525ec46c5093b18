"""The fused residual add + RMSNorm op (models/norm_kernel.py) against the formula in float64
with autograd, forward and backward: its torch formula here, its Triton kernels under the
interpreter on CPU and compiled on a GPU; and a model with `fused_norm` against one without."""

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
from pipeline.models import norm_kernel
from pipeline.models.norm_kernel import add_rms_norm, kernel_supported

def reference(x, delta, w, eps):
    s = x if delta is None else x + delta
    return s, w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))

g = torch.Generator().manual_seed(0)
eps = 1e-6
# the backward's tiling as the module sets it, then several rows a step over few programs
# (rows left over in the last step, several steps each) and its partial sums in short steps
tilings = ((norm_kernel.ROWS, norm_kernel.ROW_PROGRAMS, norm_kernel.FINISH_ROWS), (4, 3, 2))
cases = ((37, 96, True, True), (5, 130, True, False), (23, 64, False, False))
for (rows_per_step, programs, parts), (rows, hidden, with_delta, residual) in (
    (t, c) for t in tilings for c in cases
):
    norm_kernel.ROWS, norm_kernel.ROW_PROGRAMS, norm_kernel.FINISH_ROWS = (
        rows_per_step, programs, parts
    )
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, DTYPE)
    delta = torch.randn(rows, hidden, generator=g).to(DEVICE, DTYPE) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, DTYPE)
    dy = torch.randn(rows, hidden, generator=g).to(DEVICE, DTYPE)
    ds = torch.randn(rows, hidden, generator=g).to(DEVICE, DTYPE)
    assert kernel_supported(x) == KERNEL
    outs = []
    for fused in (True, False):
        leaves = [t.clone() if fused else t.double() for t in (x, delta, w) if t is not None]
        for t in leaves:
            t.requires_grad_()
        xx, ww = leaves[0], leaves[-1]
        dd = leaves[1] if with_delta else None
        s, y = add_rms_norm(xx, dd, ww, eps) if fused else reference(xx, dd, ww, eps)
        outputs, grads = [y], [dy]
        if residual:
            outputs.append(s)
            grads.append(ds)
        torch.autograd.backward(outputs, [t.to(y.dtype) for t in grads])
        outs.append([s.detach(), y.detach()] + [t.grad for t in leaves])
    names = ["s", "y", "d x"] + (["d delta"] if with_delta else []) + ["d w"]
    for name, a, b in zip(names, *outs):
        assert a.shape == b.shape, name
        scale = max(1.0, b.abs().max().item())
        err = (a.double().cpu() - b.double().cpu()).abs().max().item() / scale
        assert err < ATOL, (name, rows, hidden, err)

# compiled: one opaque op inside the graph, the same values
f = torch.compile(lambda a, b, c: [o.sum() for o in add_rms_norm(a, b, c, eps)], fullgraph=True)
torch.testing.assert_close(f(x, x, w), [o.sum() for o in add_rms_norm(x, x, w, eps)])
"""
    + model_parity(
        "fused_norm on the trunk and every block",
        3,
        "    model.model.fused_norm = fused\n"
        "    for block in model.model.layers:\n"
        "        block.fused_norm = fused",
    )
    + """
print("norm ok")
"""
)


def test_torch_formula_matches_float64_where_triton_does_not_run():
    check_formula_on_cpu(CHECK)


@needs_triton
def test_kernels_match_float64_under_the_triton_interpreter():
    assert "norm ok" in check_interpreted(CHECK)


@pytest.mark.gpu
@needs_cuda
def test_kernels_match_float64_in_bf16_on_cuda():
    # bf16 outputs and gradients rounded as autograd rounds the unfused formula's steps
    # (<= a few 2^-9 relative) against float64 on the same bf16 inputs
    assert "norm ok" in check_cuda_bf16(CHECK)
