"""ComputeWeights on CPU: low-precision compute copies inside, float32 masters and float32
gradient accumulation outside (the CUDA end-to-end check is in test_precision_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.training.precision import ComputeWeights


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2, bias=False))


def _bf16_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The bfloat16 gradients one backward leaves, as float32."""
    low = _model().to(torch.bfloat16)
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    low(x.to(torch.bfloat16)).square().sum().backward()
    return [p.grad.float() for p in low.parameters()]


def test_micro_batches_accumulate_in_float32_and_masters_come_back():
    model = _model()
    masters = [p.detach().clone() for p in model.parameters()]
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weights = ComputeWeights(model, torch.bfloat16)
    with weights():
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for x in xs:
            model(x.to(torch.bfloat16)).square().sum().backward()
            weights.flush()
            assert all(p.grad is None for p in model.parameters())  # moved out at once
    expected = [sum(gs) for gs in zip(*(_bf16_grads(model, x) for x in xs), strict=True)]
    for p, master, want in zip(model.parameters(), masters, expected, strict=True):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.detach(), master, rtol=0, atol=0)  # masters untouched
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-6)


def test_gradients_from_before_keep_adding_up_and_exit_flushes_the_last_backward():
    model = _model()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    weights = ComputeWeights(model, torch.bfloat16)
    with weights():
        model(x.to(torch.bfloat16)).square().sum().backward()  # no flush: exit does it
    for p, g in zip(model.parameters(), _bf16_grads(model, x), strict=True):
        torch.testing.assert_close(p.grad, g + 1.0, rtol=1e-6, atol=1e-6)


def test_an_exception_inside_drops_the_unflushed_backward_and_restores_masters():
    model = _model()
    weights = ComputeWeights(model, torch.bfloat16)
    x = torch.randn(2, 6)
    with pytest.raises(RuntimeError, match="boom"), weights():
        model(x.to(torch.bfloat16)).sum().backward()
        raise RuntimeError("boom")
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert not weights.active


def test_prepare_refreshes_the_copies_for_the_next_entry_only():
    model = _model()
    weights = ComputeWeights(model, torch.bfloat16)
    first = next(model.parameters())
    before = first.detach().clone()

    def inside() -> torch.Tensor:
        with weights():
            return first.detach().clone()  # the bfloat16 compute copy

    weights.prepare()  # the copy is made now; the next entry must not copy again
    with torch.no_grad():
        first.add_(1.0)  # so a master changed in between (the engine never does this)
    assert torch.equal(inside(), before.bfloat16())  # is not seen by that entry,
    assert torch.equal(inside(), first.detach().bfloat16())  # but by the next one
    weights.prepare()
    weights.discard()  # a discarded prepare: the entry copies again
    with torch.no_grad():
        first.add_(1.0)
    assert torch.equal(inside(), first.detach().bfloat16())
    with weights.prepared():  # discards on the way out what its body left unconsumed
        pass
    with torch.no_grad():
        first.add_(1.0)
    assert torch.equal(inside(), first.detach().bfloat16())
