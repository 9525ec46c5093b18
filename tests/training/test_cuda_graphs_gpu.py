"""On CUDA: the trunk under CUDA graphs (trainer.compile_mode = reduce-overhead, also with
the h200 profile's inductor options, or our own graphs with trainer.trunk_graphs) with
bucketed packing trains like the plain compiled trunk, across batches of different shapes."""

from __future__ import annotations

import pytest
import torch
from bench.shapes import SHAPES

from pipeline.algorithms import AlgorithmConfig
from pipeline.models import CausalLM
from pipeline.training import ExperienceBatch, PolicyTrainer, TrainerConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batch(seed: int, n: int, prompt: int, response: int, vocab: int) -> ExperienceBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, prompt + response), generator=gen)
    return ExperienceBatch.from_lists(
        prompt_ids=list(ids[:, :prompt]),
        response_ids=[r[: response - (i % 3)] for i, r in enumerate(ids[:, prompt:])],
        behaviour_logprobs=[-torch.rand(response - (i % 3), generator=gen) for i in range(n)],
        scores=torch.zeros(n),
        uids=[f"p{i // 4}/{i % 4}" for i in range(n)],
        advantages=[torch.randn(response - (i % 3), generator=gen) for i in range(n)],
    )


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_trunk_with_buckets_trains_like_the_compiled_trunk():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = SHAPES["tiny"].replace(num_hidden_layers=2)
    base = CausalLM(config)
    base.init_weights()
    # three shapes: different token totals and sequence counts, two micro-batches each
    batches = [
        _batch(1, 8, 16, 24, config.vocab_size),
        _batch(2, 12, 10, 30, config.vocab_size),
        _batch(3, 8, 16, 24, config.vocab_size),
    ]
    runs: dict[str, dict[str, torch.Tensor]] = {}
    results: dict[str, list[dict[str, float]]] = {}
    options = {"triton.mix_order_reduction": False, "triton.enable_pdl": True}
    for run, mode, bucket in (
        ("default", "default", 0),
        ("reduce-overhead", "reduce-overhead", 64),
        ("options", "reduce-overhead", 64),
        ("trunk_graphs", "default", 64),
        ("packed_mlp", "reduce-overhead", 64),
    ):
        model = CausalLM(config)
        model.load_state_dict(base.state_dict())
        cfg = TrainerConfig(
            lr=1e-3,
            device="cuda",
            param_dtype="bfloat16",
            max_tokens_per_micro_batch=256,
            compile=True,
            compile_mode=mode,
            pack_bucket_tokens=bucket,
            trunk_graphs=run == "trunk_graphs",
            compile_options=options if run in ("options", "packed_mlp") else {},
            packed_mlp=run == "packed_mlp",
        )
        trainer = PolicyTrainer(model, cfg, AlgorithmConfig(advantage_estimator="grpo"))
        # packed: gate|up is a view of the flat optimizer's buffers inside the CUDA graphs
        mlps = [layer.mlp for layer in trainer.model.model.layers]
        assert [m.adjacent for m in mlps] == [run == "packed_mlp"] * len(mlps)
        counters.clear()
        metrics = [trainer.train_step(b) for b in batches]
        if mode == "reduce-overhead":
            assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        if run == "trunk_graphs":  # several bucketed shapes, every micro-batch replayed
            graphs = trainer.model.packed_runner
            assert graphs is not None and len(graphs.shapes) >= 2, graphs.shapes
            assert graphs.replays >= 6 and graphs.fallbacks == 0
        runs[run] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        results[run] = metrics
    plain_m = results["default"]
    plain = runs["default"]
    graphed_runs = ("reduce-overhead", "options", "trunk_graphs", "packed_mlp")
    for graphed_m in (results[run] for run in graphed_runs):
        for a, b in zip(plain_m, graphed_m, strict=True):
            assert b["actor/skipped_updates"] == 0
            pg = a["actor/pg_loss"]
            assert abs(pg - b["actor/pg_loss"]) < 1e-3 + 1e-2 * abs(pg)
            assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 0.02 * a["actor/grad_norm"]
    # Adam moves each weight by about lr per step in its gradient's sign; other GEMM shapes
    # (padding) round bf16 differently, which flips only near-zero gradients
    start = {k: v.cuda() for k, v in base.state_dict().items()}
    moved = {
        run: torch.cat([(p[k] - start[k]).flatten() for k in plain]) for run, p in runs.items()
    }
    for graphed in graphed_runs:
        agree = (torch.sign(moved["default"]) == torch.sign(moved[graphed])).float().mean()
        assert agree > 0.95, (graphed, float(agree))
    assert moved["default"].abs().mean() > 1e-4  # the runs did train (lr 1e-3, 3 steps)
