"""FlatAdamW: the flat-buffer AdamW equals torch's per-parameter AdamW (clip, skip, schedule,
a state reload), on CPU through torch's fused kernel on the flat buffers and, under Triton's
interpreter, through the Triton kernel that runs on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.models.logit_stats import triton as _triton
from pipeline.training.flat_adamw import ALIGN, FlatAdamW
from pipeline.training.precision import ComputeWeights

from ..models.triton_helpers import NO_TRITON, interpret, run_script

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: the flat views need alignment gaps
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def _flat_setup(
    device: str = "cpu", exp_avg_dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, ComputeWeights, torch.optim.AdamW, FlatAdamW]:
    model = _model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    for p in model.parameters():  # what init_adam_state does: step counts on the device
        optimizer.state[p] = {
            "step": torch.tensor(0.0, device=device),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    weights = ComputeWeights(model, torch.bfloat16, flat=True)
    assert weights.layout is not None and weights.layout.total % ALIGN == 0
    flat = FlatAdamW(optimizer, weights, exp_avg_dtype=exp_avg_dtype)
    return model, weights, optimizer, flat


def _backward(
    model: nn.Module, weights: ComputeWeights, seed: int, scale: float = 1.0, defer: bool = False
) -> None:
    """One backward inside `weights` (with `defer`, its gradients stay pending in bf16)."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)).to(
        weights.params[0].device
    )
    with weights(defer=defer):
        (scale * model(x.bfloat16()).square().sum()).backward()


def _reference_step(
    ref: nn.Module, opt: torch.optim.Optimizer, grads: list[torch.Tensor], max_norm: float
) -> None:
    for p, g in zip(ref.parameters(), grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_flat_steps_equal_torch_adamw_with_clip_skip_and_schedule():
    model, weights, optimizer, flat = _flat_setup()
    ref = copy.deepcopy(_model())
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    lrs = [1e-2, 5e-3, 2e-3, 1e-3]
    for step, lr in enumerate(lrs):
        optimizer.param_groups[0]["lr"] = ref_opt.param_groups[0]["lr"] = lr
        _backward(model, weights, seed=step, scale=50.0 if step == 1 else 1.0)
        grads = [p.grad.clone() for p in model.parameters()]
        assert flat.ready()  # masters, gradients and moments are the flat views
        bad = torch.tensor(step == 2)  # the third update is skipped (e.g. a NaN loss)
        norm, skipped = flat.guarded_step(0.5, bad)
        optimizer.zero_grad(set_to_none=True)
        assert bool(skipped) == (step == 2)
        torch.testing.assert_close(
            norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        )
        if step != 2:
            _reference_step(ref, ref_opt, grads, 0.5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(
                optimizer.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"], rtol=1e-5, atol=1e-7
            )
            assert float(optimizer.state[p]["step"]) == float(ref_opt.state[q]["step"])
    assert float(optimizer.state[next(model.parameters())]["step"]) == 3  # one skipped


def test_a_reloaded_state_is_bound_again_and_training_continues_identically():
    runs = []
    for reload in (False, True):
        model, weights, optimizer, flat = _flat_setup()
        for step in range(3):
            if reload and step == 2:  # replaces every state tensor, as a checkpoint load
                optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
                p0 = next(model.parameters())
                assert optimizer.state[p0]["exp_avg"].data_ptr() != flat.exp_avg.data_ptr()
            _backward(model, weights, seed=step)
            assert flat.ready()
            flat.guarded_step(None, torch.tensor(False))
            optimizer.zero_grad(set_to_none=True)
        runs.append([p.detach().clone() for p in model.parameters()])
        p0 = next(model.parameters())
        assert optimizer.state[p0]["exp_avg"].data_ptr() == flat.exp_avg.data_ptr()
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("moment", [torch.float32, torch.bfloat16])
def test_a_parameter_without_a_gradient_turns_the_flat_path_off(moment: torch.dtype):
    model, weights, optimizer, flat = _flat_setup(exp_avg_dtype=moment)
    _backward(model, weights, seed=0)
    model[2].weight.grad = None
    assert not flat.ready() and flat.disabled
    _backward(model, weights, seed=1)
    assert not flat.ready()  # stays off: the torch step would leave its count behind
    # torch's AdamW takes over with float32 moments (a bf16 one is widened, keeping values)
    params = list(model.parameters())
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.float32 for p in params)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    assert not torch.equal(params[0].detach(), before[0])


CPU = "import torch\nDEVICE = 'cpu'\n"
CUDA = "import torch\nDEVICE = 'cuda'\n"
TRITON_CHECK = """
import torch
from pipeline.training import flat_adamw
from tests.training.test_flat_adamw import _backward, _flat_setup

assert flat_adamw._triton_runs(torch.zeros(1, device=DEVICE))
flat_adamw.NORM_GROUP = 2  # the norm kernel's three blocks in two programs, one slot past
results = {torch.float32: [], torch.bfloat16: []}
# Triton reading the float32 accumulators; Triton reading the pending bf16 gradients in
# place (GradTable); torch's fused kernel (pending gradients copied to float32 first); each
# with the first moment in float32 and in bfloat16
for moment, (use_triton, defer) in (
    (m, path) for m in results for path in ((True, False), (True, True), (False, True))
):
    flat_adamw._triton_runs = (lambda t: True) if use_triton else (lambda t: False)
    model, weights, optimizer, flat = _flat_setup(DEVICE, moment)
    assert all(optimizer.state[p]["exp_avg"].dtype == moment for p in model.parameters())
    norms = []
    for step in range(3):
        optimizer.param_groups[0]["lr"] = 1e-2 / (step + 1)
        _backward(model, weights, seed=step, scale=50.0 if step == 1 else 1.0, defer=defer)
        assert (weights.pending_grads() is not None) == defer
        assert flat.ready()
        norm, _ = flat.guarded_step(0.5, torch.tensor(step == 2, device=DEVICE))
        assert weights.pending_grads() is None
        # the Triton kernels write the compute copies with the masters, rounded as torch
        # rounds (the next entry skips its refresh and computes with them); torch's kernel
        # leaves them stale
        fresh = torch.equal(weights.flat_low, flat.masters.to(weights.flat_low.dtype))
        assert weights._fresh == use_triton and (fresh or not use_triton)
        norms.append(norm)
        optimizer.zero_grad(set_to_none=True)
    results[moment].append([t.clone() for t in (flat.masters, flat.exp_avg, flat.exp_avg_sq, *norms)])
for moment, runs in results.items():
    # the three paths agree (a bf16 moment: up to a rounding flipped by float32 round-off)
    rtol = 1e-5 if moment == torch.float32 else 8e-3
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            torch.testing.assert_close(a, b, rtol=rtol, atol=1e-7)
# a bf16 first moment is the float32 one rounded, step by step: close to it, not equal
full, low = results[torch.float32][0], results[torch.bfloat16][0]
assert not torch.equal(full[1], low[1].float())
assert (low[1].float() - full[1]).abs().max() < 1e-2 * full[1].abs().max()
moved = (full[0] - _flat_setup(DEVICE)[3].masters).abs().max()
assert (low[0] - full[0]).abs().max() < 0.05 * moved
print("flat kernel ok")
"""


@pytest.mark.skipif(_triton is None, reason=NO_TRITON)
def test_the_triton_kernel_equals_torch_fused_adamw_under_the_interpreter():
    assert "flat kernel ok" in interpret(TRITON_CHECK.replace("import torch\n", CPU, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_triton_kernel_equals_torch_fused_adamw_on_cuda():
    assert "flat kernel ok" in run_script(TRITON_CHECK.replace("import torch\n", CUDA, 1))


def test_guarded_step_reads_nothing_back_before_the_update():
    """The step counts' increment (1 - found_inf) stays on the device: a 0-dim tensor
    passed where torch also accepts a Scalar is read back with `item` (a host sync on CUDA
    that stalled every step until the backward had drained)."""
    from torch.profiler import profile

    model, weights, _, flat = _flat_setup()
    _backward(model, weights, seed=1)
    assert flat.ready()
    with profile() as prof:
        flat.guarded_step(1.0, torch.zeros((), dtype=torch.bool))

    def inside_update(event: object) -> bool:  # the CPU fallback kernel may read its flags
        parent = getattr(event, "cpu_parent", None)
        while parent is not None:
            if parent.name == "aten::_fused_adamw_":
                return True
            parent = parent.cpu_parent
        return False

    reads = [e.name for e in prof.events() if e.name == "aten::item" and not inside_update(e)]
    assert not reads, f"host reads outside the update kernel: {reads}"
