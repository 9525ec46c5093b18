"""The Triton log-prob kernels (models/logit_stats.py: one-read statistics, the gradient)
against float64, and the fused log-prob function running them: under Triton's interpreter
on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from .triton_helpers import HAS_TRITON, NO_TRITON, interpret, run_script

CHECK = """
import torch
from pipeline.models.logit_stats import BLOCK, logit_grad, logit_stats, kernels_supported
from pipeline.models.logprobs import _logit_grad, _logit_stats, chunked_token_logprobs

def reference(logits, targets, temperature):
    z = logits.double() / temperature
    logq = z.log_softmax(-1)
    logp = logq.gather(-1, targets[:, None]).squeeze(-1)
    return logp, z.logsumexp(-1), -(logq.exp() * logq).sum(-1)

g = torch.Generator().manual_seed(0)
vocab = 2 * BLOCK + 37  # two full blocks and a ragged one
logits = (3 * torch.randn(6, vocab, generator=g)).to(DEVICE, DTYPE)
# the running maximum grows block after block (the rescaling), or sits in the first one
logits[1] += torch.linspace(0, 40, vocab).to(DEVICE, DTYPE)
logits[2, 5] = 60
targets = torch.randint(0, vocab, (6,), generator=g).to(DEVICE)
targets[2] = 5
assert kernels_supported(logits)
for temperature in (1.0, 0.7):
    want = reference(logits.cpu(), targets.cpu(), temperature)
    got = logit_stats(logits, targets, temperature, True)
    for name, a, b in zip(("logp", "lse", "entropy"), got, want):
        assert a.dtype == torch.float32 and a.shape == (6,)
        err = (a.cpu().double() - b).abs().max().item()
        assert err < ATOL, (name, temperature, err)
    logp, lse, ent = logit_stats(logits, targets, temperature, False)
    assert ent.numel() == 0 and torch.equal(logp, got[0]) and torch.equal(lse, got[1])
    torch_version = _logit_stats(logits, targets, temperature, True)
    for a, b in zip(got, torch_version):
        assert (a - b).abs().max().item() < ATOL

    # the gradient kernel: d(sum g_logp * logp + g_ent * H)/d(logits) by float64 autograd
    g_logp = torch.randn(6, generator=g).to(DEVICE)
    g_ent = torch.randn(6, generator=g).to(DEVICE)
    x = logits.cpu().double().requires_grad_()
    logq = (x / temperature).log_softmax(-1)
    logp = logq.gather(-1, targets.cpu()[:, None]).squeeze(-1)
    ent = -(logq.exp() * logq).sum(-1)
    (logp * g_logp.cpu().double() + ent * g_ent.cpu().double()).sum().backward()
    _, lse, ent = got
    grad = logit_grad(logits, targets, lse, g_logp, g_ent, ent, temperature)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    scale = max(1.0, x.grad.abs().max().item())
    err = (grad.cpu().double() - x.grad).abs().max().item() / scale
    assert err < GRAD_TOL, ("grad", temperature, err)
    torch_grad = _logit_grad(logits, targets, lse, g_logp, g_ent, ent, temperature)
    assert (grad.float() - torch_grad.float()).abs().max().item() / scale < GRAD_TOL
    # a sum's gradient as autograd hands it: one value expanded over the rows (stride 0)
    ones = torch.ones((), device=DEVICE).expand(6)
    grad = logit_grad(logits, targets, lse, ones, g_ent, ent, temperature)
    torch_grad = _logit_grad(logits, targets, lse, ones, g_ent, ent, temperature)
    assert (grad.float() - torch_grad.float()).abs().max().item() / scale < GRAD_TOL

# the fused log-prob function with the kernel inside: the same values and gradients as with
# the torch statistics pass (same GEMMs, same gradient pass: only the statistics differ)
from pipeline.models import logprobs

hidden = (0.3 * torch.randn(10, 16, generator=g)).to(DEVICE, DTYPE)
weight = torch.randn(vocab, 16, generator=g).to(DEVICE, DTYPE)
tokens = torch.randint(0, vocab, (10,), generator=g).to(DEVICE)

def fused():
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = chunked_token_logprobs(h, w, tokens, chunk_tokens=4, return_entropy=True)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return [t.detach().float() for t in (logp, ent, h.grad, w.grad)]

with_kernel = fused()
logprobs._KERNELS._triton_failed = True  # what a failed kernel falls back to
without = fused()
logprobs._KERNELS._triton_failed = False
for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), with_kernel, without):
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err < (ATOL if name in ("logp", "entropy") else GRAD_TOL), (name, err)
print("stats ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason=NO_TRITON)
def test_stats_kernel_matches_float64_under_the_triton_interpreter():
    prelude = "DEVICE, DTYPE, ATOL, GRAD_TOL = 'cpu', torch.float32, 1e-4, 1e-4\n"
    assert "stats ok" in interpret(CHECK.replace("import torch\n", "import torch\n" + prelude))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stats_kernel_matches_float64_in_bf16_on_cuda():
    # bf16 logits are rounded before either version reads them: the reference sees the same
    prelude = "DEVICE, DTYPE, ATOL, GRAD_TOL = 'cuda', torch.bfloat16, 2e-3, 1e-2\n"
    assert "stats ok" in run_script(CHECK.replace("import torch\n", "import torch\n" + prelude))
