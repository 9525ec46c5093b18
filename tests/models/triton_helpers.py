"""Running a Triton kernel check in a subprocess: under the interpreter on CPU
(TRITON_INTERPRET=1 must be set before Triton compiles anything), compiled on a GPU host."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "Triton is not installed (CPU builds of torch)"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=NO_TRITON)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_script(script: str, **env: str) -> str:
    path = os.pathsep.join(["src", "tests", os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **env, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def interpret(script: str) -> str:
    return run_script(script, TRITON_INTERPRET="1")


def prelude(device: str, dtype: str, atol: float, model_tol: float, kernel: bool) -> str:
    """The constants a kernel check script reads, set first (after `import torch`)."""
    return (
        f"DEVICE, DTYPE, ATOL, MODEL_TOL, KERNEL = {device!r}, torch.{dtype}, {atol}, "
        f"{model_tol}, {kernel}\n"
    )


def with_prelude(
    check: str, device: str, dtype: str, atol: float, model_tol: float, kernel: bool
) -> str:
    """`check` with `prelude(...)` right after its `import torch`."""
    lines = prelude(device, dtype, atol, model_tol, kernel)
    return check.replace("import torch\n", "import torch\n" + lines, 1)


def check_formula_on_cpu(check: str) -> None:
    """A prelude-style check (see `with_prelude`) on its torch formula, float32, in-process."""
    exec(with_prelude(check, "cpu", "float32", 1e-5, 1e-5, False), {})


def check_interpreted(check: str) -> str:
    """The same check on the Triton kernels under the interpreter (float32): its stdout."""
    return interpret(with_prelude(check, "cpu", "float32", 1e-5, 1e-5, True))


def check_cuda_bf16(check: str) -> str:
    """The same check compiled on a GPU in bf16 (kernel and model tolerances 3e-2, 5e-2)."""
    return run_script(with_prelude(check, "cuda", "bfloat16", 3e-2, 5e-2, True))


def model_parity(what: str, layers: int, switch: str) -> str:
    """Script lines: a small packed qwen2 model with a switch off and on (`switch`, code run
    with `model` and `fused` bound) gives the same logits and gradients within MODEL_TOL.
    Draws its inputs from the script's generator `g`."""
    return f"""
# a model: {what} gives the same logits and gradients, packed
from pipeline.models import CausalLM, ModelConfig
config = ModelConfig(model_type="qwen2", vocab_size=61, hidden_size=64, intermediate_size=96,
                     num_hidden_layers={layers}, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, attention_bias=True)
ids = torch.randint(0, 61, (1, 23), generator=g).to(DEVICE)
positions = torch.cat([torch.arange(9), torch.arange(14)])[None].to(DEVICE)
cu = torch.tensor([0, 9, 23]).to(DEVICE)
runs = []
for fused in (False, True):
    torch.manual_seed(0)
    model = CausalLM(config).to(DEVICE, DTYPE)
{switch}
    logits = model.forward_packed(ids, positions, cu)
    logits.float().square().mean().backward()
    runs.append([logits.detach().float()] + [p.grad.float() for p in model.parameters()])
for a, b in zip(*runs):
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err < MODEL_TOL, err
"""
