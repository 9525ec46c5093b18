"""On CUDA: the fused log-prob kernels (compiled) and the single-process bf16 compute copies
over float32 masters give the answers of plain float32 autograd within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch
from bench.shapes import SHAPES

from pipeline.algorithms import AlgorithmConfig
from pipeline.models import CausalLM, chunked_token_logprobs
from pipeline.training import PolicyTrainer, TrainerConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_compiled_logprob_kernels_match_log_softmax_in_value_and_gradient():
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, dim, vocab = 3000, 64, 5000  # chunks of 1024, 1024, 952
    hidden = torch.randn(tokens, dim, device="cuda", generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, device="cuda", generator=gen).mul_(0.1).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    up_lp, up_ent = torch.randn(2, tokens, device="cuda", generator=gen)
    logp, ent = chunked_token_logprobs(
        hidden, weight, targets, chunk_tokens=1024, temperature=0.8, return_entropy=True
    )
    ((logp * up_lp).sum() + (ent * up_ent).sum()).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = (hidden @ weight.t()) / 0.8
    ref_all = torch.log_softmax(logits, -1)
    ref_lp = ref_all.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    ((ref_lp * up_lp).sum() + (ref_ent * up_ent).sum()).backward()
    torch.testing.assert_close(logp, ref_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(got[1], weight.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_bf16_compute_copies_train_like_float32_and_keep_float32_masters(tmp_path):
    from pipeline.training import ExperienceBatch

    torch.manual_seed(0)
    config = SHAPES["tiny"].replace(num_hidden_layers=2)
    base = CausalLM(config)
    base.init_weights()
    gen = torch.Generator().manual_seed(1)
    n, p, r = 8, 16, 24
    ids = torch.randint(1, config.vocab_size, (n, p + r), generator=gen)
    batch = ExperienceBatch.from_lists(
        prompt_ids=list(ids[:, :p]),
        response_ids=list(ids[:, p:]),
        behaviour_logprobs=list(-torch.rand(n, r, generator=gen)),
        scores=torch.zeros(n),
        uids=[f"p{i // 4}/{i % 4}" for i in range(n)],
        advantages=list(torch.randn(n, r, generator=gen)),
    )
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = CausalLM(config)
        model.load_state_dict(base.state_dict())
        cfg = TrainerConfig(
            lr=1e-3, device="cuda", param_dtype=dtype, max_tokens_per_micro_batch=128
        )
        trainer = PolicyTrainer(model, cfg, AlgorithmConfig(advantage_estimator="grpo"))
        metrics = trainer.train_step(batch)  # several micro-batches: float32 accumulation
        assert metrics["actor/skipped_updates"] == 0
        params = dict(trainer.model.named_parameters())
        assert all(t.dtype == torch.float32 for t in params.values())
        results[dtype] = ({k: v.detach().clone() for k, v in params.items()}, metrics)
    f32, b16 = results["float32"], results["bfloat16"]
    assert (
        abs(f32[1]["actor/grad_norm"] - b16[1]["actor/grad_norm"])
        < 0.05 * f32[1]["actor/grad_norm"]
    )
    # Adam's first step moves every weight by about lr in the gradient's sign; bf16 compute
    # keeps that direction for almost all of them (k_proj.bias has a ~0 gradient: noise)
    deltas = {
        dtype: torch.cat([(v - base.state_dict()[k].cuda()).flatten() for k, v in res[0].items()])
        for dtype, res in results.items()
    }
    agree = (torch.sign(deltas["float32"]) == torch.sign(deltas["bfloat16"])).float().mean()
    assert agree > 0.9, float(agree)
