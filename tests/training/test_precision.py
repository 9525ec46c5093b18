"""ComputeWeights on CPU: low-precision compute copies inside, float32 masters and float32
gradient accumulation outside (the CUDA end-to-end check is in test_precision_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.training.precision import ComputeWeights, data_ptrs_equal


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


@pytest.mark.parametrize("backwards", [1, 3])
def test_deferred_gradients_stay_pending_for_one_backward_and_add_up_for_several(backwards):
    """Under `defer` (flat layout), a single backward's bf16 gradients are kept as they are
    for the optimizer; `materialize` gives exactly what a plain entry leaves. A second
    backward moves the first one's into float32 and accumulates as usual."""
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    results = []
    for defer in (True, False):
        model = _model()
        weights = ComputeWeights(model, torch.bfloat16, flat=True)
        with weights(defer=defer):
            for x in xs[:backwards]:
                model(x.to(torch.bfloat16)).square().sum().backward()
                weights.flush()
        pending = weights.pending_grads()
        if defer and backwards == 1:
            assert pending is not None and all(g.dtype == torch.bfloat16 for g in pending)
            # .grad already names the float32 accumulators (for the flat optimizer's checks)
            assert weights.layout is not None and weights.flat_grads is not None
            assert weights.layout.holds(weights.flat_grads, [p.grad for p in model.parameters()])
            weights.materialize()
            assert weights.pending_grads() is None
            for p, g in zip(model.parameters(), pending, strict=True):
                assert torch.equal(p.grad, g.float())
        else:
            assert pending is None
        results.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_an_unconsumed_deferral_is_materialized_by_the_next_entry():
    model = _model()
    weights = ComputeWeights(model, torch.bfloat16, flat=True)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    with weights(defer=True):
        model(x.to(torch.bfloat16)).square().sum().backward()
    assert weights.pending_grads() is not None
    with weights():  # gradients so far keep adding up, the pending ones included
        model(y.to(torch.bfloat16)).square().sum().backward()
    assert weights.pending_grads() is None
    plain = _model()
    expected = [a + b for a, b in zip(_bf16_grads(plain, x), _bf16_grads(plain, y), strict=True)]
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-6)


def test_deferral_needs_the_flat_layout_and_an_exception_drops_pending():
    model = _model()
    weights = ComputeWeights(model, torch.bfloat16)  # not flat: nothing reads bf16 in place
    with weights(defer=True):
        model(torch.randn(2, 6).to(torch.bfloat16)).sum().backward()
    assert weights.pending_grads() is None and next(model.parameters()).grad is not None
    flat_model = _model()
    flat = ComputeWeights(flat_model, torch.bfloat16, flat=True)
    with pytest.raises(RuntimeError, match="boom"), flat(defer=True):
        flat_model(torch.randn(2, 6).to(torch.bfloat16)).sum().backward()
        flat.flush()
        raise RuntimeError("boom")
    assert flat.pending_grads() is None
    assert all(p.grad is None and p.dtype == torch.float32 for p in flat_model.parameters())


def test_data_ptrs_equal_sees_a_moved_tensor():
    tensors = [torch.zeros(3), torch.zeros(5)]
    ptrs = [t.data_ptr() for t in tensors]
    assert data_ptrs_equal(tensors, ptrs)
    tensors[1].data = torch.zeros(5)  # a load that replaced the storage instead of copying
    assert not data_ptrs_equal(tensors, ptrs)
