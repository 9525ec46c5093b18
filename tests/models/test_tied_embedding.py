"""The tied embedding's gradient rows added into the output layer's gradient in place
(models/tied_embedding.py): the same gradient as the dense path, with repeated tokens; the
in-place path really taken (no dense table gradient); and a tied model with
`tied_grad_rows` against one without."""

from __future__ import annotations

import pytest
import torch

from pipeline.models import CausalLM

from .conftest import FAMILY_CONFIGS
from .triton_helpers import interpret, needs_cuda, needs_triton, run_script

CHECK = """
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from pipeline.models.logprobs import chunked_token_logprobs
from pipeline.models.tied_embedding import TiedGrad, add_rows_, tied_embedding

g = torch.Generator().manual_seed(0)
V, H, n = 50, 24, 40
ids = torch.randint(0, V, (n,), generator=g)
ids[:6] = 7  # a repeated token: its rows sum before the add
ids = ids.to(DEVICE)
for dtype in (torch.float32, torch.bfloat16):
    table = torch.randn(V, H, generator=g).to(DEVICE, dtype)
    rows = torch.randn(n, H, generator=g).to(DEVICE, dtype)
    dense = torch.zeros(V, H, device=DEVICE).index_add_(0, ids, rows.float())
    expect = table + dense.to(dtype)
    got = add_rows_(table.clone(), ids, rows)
    torch.testing.assert_close(got, expect, rtol=0, atol=ATOL[dtype])

# the output layer over an embedding of the same (tied) table: in place vs dense
targets = torch.randint(0, V, (n,), generator=g).to(DEVICE)
w0 = torch.randn(V, H, generator=g).to(DEVICE, DTYPE)
grads, ops = [], []
for in_place in (True, False):
    w = w0.clone().requires_grad_()
    slot = TiedGrad()
    x = tied_embedding(ids, w, slot) if in_place else F.embedding(ids, w)
    h = torch.tanh(x * 3)  # a stand-in trunk
    logp = chunked_token_logprobs(h, w, targets, chunk_tokens=16, tied=slot if in_place else None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (logp * torch.linspace(-1, 1, n, device=DEVICE)).sum().backward()
    grads.append(w.grad.float())
    ops.append({e.name for e in prof.events()})
    assert slot.grad is None  # consumed by the embedding's backward
torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=ATOL[DTYPE])
assert grads[0][7].abs().sum() > 0
# in place: the rows went in by the kernel, no dense table gradient was built or added
assert "aten::index_add_" not in ops[0] and "aten::embedding_backward" not in ops[0], ops[0]
assert "aten::embedding_backward" in ops[1]

# an empty slot (the output layer not ours): the dense gradient, as F.embedding's
w = w0.clone().requires_grad_()
(tied_embedding(ids, w, TiedGrad()).float() * 2).sum().backward()
w2 = w0.clone().requires_grad_()
(F.embedding(ids, w2).float() * 2).sum().backward()
torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=ATOL[DTYPE])
print("ok")
"""


def _script(device: str, dtype: str, exact: bool) -> str:
    tol = (
        "{torch.float32: 0.0, torch.bfloat16: 0.0}"
        if exact
        else ("{torch.float32: 1e-5, torch.bfloat16: 1e-2}")
    )
    prelude = f"DEVICE, DTYPE, ATOL = {device!r}, torch.{dtype}, {tol}\n"
    return CHECK.replace("import torch\n", "import torch\n" + prelude, 1)


@needs_triton
def test_rows_add_in_place_like_the_dense_gradient_interpreted() -> None:
    """The kernel under the interpreter (CPU): bit for bit the dense path's values (the same
    summation order: ids sorted stably), float32 and bfloat16 tables."""
    assert interpret(_script("cpu", "float32", exact=True)).strip() == "ok"


@pytest.mark.gpu
@needs_triton
@needs_cuda
def test_rows_add_in_place_like_the_dense_gradient_cuda() -> None:
    """Compiled on a GPU, bfloat16 weights (the dense path's float32 atomics sum in another
    order: a bf16 ulp of tolerance)."""
    assert run_script(_script("cuda", "bfloat16", exact=False)).strip() == "ok"


def test_a_tied_model_trains_the_same_with_gradient_rows() -> None:
    """CausalLM.token_logprobs with `tied_grad_rows` (lookup outside the trunk, rows into the
    output layer's gradient) gives the logits' log-probs and every parameter's gradient of
    the plain model, packed (with scored positions) and dense; on CPU the rows go in by the
    dense fallback."""
    config = FAMILY_CONFIGS["qwen2_bias_tied"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 23), generator=g)
    ids[0, :4] = 5
    targets = torch.randint(0, config.vocab_size, (1, 23), generator=g)
    positions = torch.cat([torch.arange(9), torch.arange(14)])[None]
    cu = torch.tensor([0, 9, 23])
    scored = torch.tensor([3, 4, 5, 12, 13, 20, 21])
    runs = []
    for rows in (False, True):
        torch.manual_seed(0)
        model = CausalLM(config)
        model.tied_grad_rows = rows
        packed = model.token_logprobs(
            ids, targets, position_ids=positions, cu_seqlens=cu, score_index=scored
        )
        dense = model.token_logprobs(ids, targets)
        (packed.sum() + (dense * torch.linspace(-1, 1, 23)).sum()).backward()
        runs.append([packed.detach(), dense.detach()] + [p.grad for p in model.parameters()])
        assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
