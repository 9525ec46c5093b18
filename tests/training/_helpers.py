"""Tiny random models saved as HF dirs, random variable-length experience, free ports."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import torch

from pipeline.models import CausalLM, ModelConfig, save_model
from pipeline.training import ExperienceBatch

# qwen2 with tied embeddings: the shared embed/lm_head parameter is FSDP's tricky case
TINY = ModelConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=True,
)
TINY_LLAMA = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)


def make_model(config: ModelConfig = TINY, seed: int = 0) -> CausalLM:
    """Random weights large enough that log-probs differ visibly between tokens."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = CausalLM(config)
        model.init_weights(std=0.2)
    return model


def save_tiny_model(path: Path, config: ModelConfig = TINY, seed: int = 0) -> Path:
    save_model(make_model(config, seed), path)
    return path


def make_batch(
    seed: int,
    n: int = 8,
    vocab: int = 64,
    prompt_len: tuple[int, int] = (2, 8),
    response_len: tuple[int, int] = (1, 10),
    group_size: int = 2,
    advantages: bool = True,
) -> ExperienceBatch:
    """n samples of random lengths; behaviour log-probs near a uniform model's."""
    g = np.random.default_rng(seed)
    prompts = [g.integers(0, vocab, size=int(g.integers(*prompt_len))) for _ in range(n)]
    lengths = [int(g.integers(*response_len)) for _ in range(n)]
    responses = [g.integers(0, vocab, size=length) for length in lengths]
    behaviour = [
        (-np.log(vocab) + 0.3 * g.standard_normal(length)).astype(np.float32) for length in lengths
    ]
    optional = {}
    if advantages:
        optional["advantages"] = [
            g.standard_normal(length).astype(np.float32) for length in lengths
        ]
    return ExperienceBatch.from_lists(
        prompts,
        responses,
        behaviour,
        g.random(n).astype(np.float32),
        uids=[f"p{i // group_size}/{i % group_size}" for i in range(n)],
        token_versions=[np.zeros(length, dtype=np.int32) for length in lengths],
        **optional,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) float copies of a model's parameters, by HF name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone().cpu()
    return out


def assert_trained_alike(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    *,
    lr: float,
    updates: int,
) -> None:
    """Two training paths whose kernels decompose the same sums differently (another GEMM
    split, a fused op's formula) agree in their gradients to float32 rounding only, and
    Adam normalises a rounding difference in a near-zero gradient into a whole lr-sized
    step, possibly of the other sign. Which weights that hits depends on the CPU's
    kernels, so per-weight tolerances hold on one machine and fail on another. What holds
    on every machine: the weights moved (about an lr per update), almost none differs by
    more than a tenth of a step, the mean difference is a small share of the movement,
    and no weight is more than two opposite steps per update apart. A path that computes
    another gradient (a dropped term, a wrong op) fails all but the last."""
    assert sorted(got) == sorted(want)
    diff = torch.cat([(got[k] - v).abs().flatten() for k, v in want.items()])
    moved = torch.cat([(v - start[k]).abs().flatten() for k, v in want.items()])
    tenth = 0.1 * lr
    assert moved.mean() > 0.5 * lr, "the weights barely moved: nothing was tested"
    assert diff.mean() < 0.05 * moved.mean(), (diff.mean(), moved.mean())
    assert (diff > tenth).float().mean() < 0.02, (diff > tenth).float().mean()
    assert diff.max() <= 2 * lr * updates * 1.01, diff.max()


def assert_transformers_runs_it(directory: Path, model: torch.nn.Module) -> None:
    """transformers loads the exported `directory` and gives `model`'s logits."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    batch = make_batch(seed=1)
    ids = torch.cat([batch.prompt_ids[0], batch.response_ids[0]])[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
