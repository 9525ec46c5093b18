"""The kernel probe behind `varlen_grouped` and `cudnn_rows_supported`: it accepts a kernel
only when output and q/k/v gradients match the reference, and refuses one that raises."""

from __future__ import annotations

import torch

from pipeline.models.attention import _agrees, _probe_inputs, rows_causal


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return rows_causal(q, k, v, 3, cudnn=False)


class _WrongKeyGrad(torch.autograd.Function):
    """Identity forward, a key gradient scaled by 2 in backward."""

    @staticmethod
    def forward(ctx, k: torch.Tensor) -> torch.Tensor:
        return k.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


def test_probe_accepts_the_same_kernel_and_refuses_wrong_gradients_or_errors():
    qkv = _probe_inputs(torch.device("cpu"), torch.float32, (1, 96), 16)
    assert qkv[0].shape == (1, 96, 4, 16) and qkv[1].shape == (1, 96, 2, 16)
    assert _agrees(_reference, _reference, qkv, 1e-5)

    def wrong_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _reference(q, _WrongKeyGrad.apply(k), v)  # right output, wrong dk

    def raises(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")

    assert not _agrees(wrong_grad, _reference, qkv, 1e-2)
    assert not _agrees(raises, _reference, qkv, 1e-2)
