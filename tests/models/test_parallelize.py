"""FSDP2 (2 ranks, gloo, CPU): sharded forward/backward equal the unsharded model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.models import CausalLM, ModelConfig, parallelize

WORLD = 2
# float32 params and reductions: sharding only changes summation order (all-reduce of grads).
ATOL = 1e-5
RTOL = 1e-4

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=True,  # the shared embed/lm_head parameter is the tricky case
)


def _worker(rank: int, init_file: str, compile_blocks: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        # a rendezvous file, not a picked port: no race with other processes for the port
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
    )
    try:
        torch.manual_seed(0)  # same weights and data on every rank
        model = CausalLM(CONFIG)
        model.init_weights(std=0.2)
        reference = copy.deepcopy(model)
        ids = torch.randint(0, CONFIG.vocab_size, (WORLD, 10))
        targets = torch.roll(ids, -1, dims=1)

        # reference: full batch, mean over ranks' per-row losses
        (reference.token_logprobs(ids, targets, chunk_tokens=7).sum() / WORLD).backward()
        with torch.no_grad():
            ref_logits = reference(ids)

        mesh = init_device_mesh("cpu", (WORLD,))
        parallelize(
            model,
            mesh,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            activation_checkpointing=True,
            # an inductor option reaches each block's compilation (a no-op on CPU)
            compile_kwargs={"options": {"triton.mix_order_reduction": False}}
            if compile_blocks
            else None,
        )
        names = sorted(n for n, _ in model.named_parameters())
        assert names == sorted(n for n, _ in reference.named_parameters()), names

        with torch.no_grad():
            logits = model(ids)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)

        # each rank trains on its own row; FSDP averages gradients across ranks
        row = slice(rank, rank + 1)
        model.token_logprobs(ids[row], targets[row], chunk_tokens=7).sum().backward()
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor()
            torch.testing.assert_close(grad, ref_params[name].grad, atol=ATOL, rtol=RTOL)
    finally:
        dist.destroy_process_group()
    # reached only on success: skip interpreter teardown, where c10d's threads can abort
    # the exit ("terminate called without an active exception") after the work passed
    os._exit(0)


def test_fsdp2_two_rank_gloo_forward_and_grads_equal_unsharded_model(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rdzv"), False), nprocs=WORLD, join=True)


@pytest.mark.slow
def test_fsdp2_with_compiled_blocks_equals_unsharded_model(tmp_path):
    # torch.compile (inductor, C++ on CPU) takes ~40 s here, hence `slow`
    mp.spawn(_worker, args=(str(tmp_path / "rdzv"), True), nprocs=WORLD, join=True)
