"""Where the half-precision Triton kernels of models/ may run (one rule for all of them)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # CPU installs: every kernel's torch formula serves
    triton = None


def half_kernel_runs(x: Tensor) -> bool:
    """Triton present and `x` a CUDA half-precision tensor, or the Triton interpreter (tests:
    TRITON_INTERPRET=1 runs the kernels on CPU tensors of any dtype)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
