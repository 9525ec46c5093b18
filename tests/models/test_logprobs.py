"""chunked_token_logprobs equals a full log_softmax gather, in value and in gradient."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from pipeline.models import ModelConfig, chunked_token_logprobs


def _reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@contextlib.contextmanager
def _saved_sizes() -> Iterator[list[int]]:
    """The element counts of the tensors autograd saves for backward inside the block."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


@pytest.mark.parametrize("keep_logits", [False, True])
def test_chunked_logprobs_entropy_and_grads_equal_full_softmax(keep_logits):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9), generator=gen)
    upstream_lp = torch.randn(2, 9, generator=gen)
    upstream_ent = torch.randn(2, 9, generator=gen)

    logp, ent = chunked_token_logprobs(
        hidden,
        weight,
        targets,
        chunk_tokens=4,
        temperature=0.7,
        return_entropy=True,
        keep_logits=keep_logits,
    )  # 18 tokens: chunks of 4, 4, 4, 4, 2
    ((logp * upstream_lp).sum() + (ent * upstream_ent).sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_lp, ref_ent = _reference(hidden, weight, targets, 0.7)
    ((ref_lp * upstream_lp).sum() + (ref_ent * upstream_ent).sum()).backward()

    torch.testing.assert_close(logp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-5)
    assert logp.dtype == torch.float32 and logp.shape == (2, 9)


def test_chunked_logprobs_saves_no_full_or_chunk_logits_for_backward():
    tokens, vocab, dim, chunk = 40, 64, 8, 16
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with _saved_sizes() as saved:
        logp = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=chunk)
    logp.sum().backward()
    assert saved, "expected the checkpoint to save its inputs"
    assert max(saved) < chunk * vocab  # only inputs are kept; logits are recomputed per chunk
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("keep_logits", [False, True])
def test_gradient_of_logprobs_alone_ignores_the_unused_entropy(keep_logits):
    """Only log p is differentiated (entropy reported, not trained): the entropy output gets
    no materialised zero gradient and the gradients are those of log p alone."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, 8, generator=gen, requires_grad=True)
    weight = torch.randn(40, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (13,), generator=gen)
    up = torch.randn(13, generator=gen)
    logp, ent = chunked_token_logprobs(
        hidden, weight, targets, chunk_tokens=5, return_entropy=True, keep_logits=keep_logits
    )
    (logp * up).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_lp, ref_ent = _reference(hidden, weight, targets, 1.0)
    (ref_lp * up).sum().backward()
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_keep_logits_saves_them_for_backward_only_when_differentiated():
    tokens, vocab, dim = 20, 30, 8
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with _saved_sizes() as saved:
        logp = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=8, keep_logits=True)
    assert max(saved) == tokens * vocab  # the logits, kept instead of recomputed
    with torch.no_grad(), _saved_sizes() as saved:
        again = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=8, keep_logits=True)
    assert saved == []  # nothing will differentiate a no-grad forward: nothing kept
    torch.testing.assert_close(again, logp.detach())


def test_model_token_logprobs_equal_log_softmax_of_forward(family_config: ModelConfig, make_native):
    model = make_native(family_config)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, family_config.vocab_size, (2, 8), generator=gen)
    targets = torch.roll(ids, -1, dims=1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    got = model.token_logprobs(ids, targets, attention_mask=mask, chunk_tokens=5)
    expected = torch.log_softmax(model(ids, attention_mask=mask).float(), -1)
    expected = expected.gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
