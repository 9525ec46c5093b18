"""A micro-batch's autograd graph is gone before the next micro-batch's forward: kept alive
(the loop's `loss` variable), it keeps the parameters' AccumulateGrad nodes of the stream it
ran on alive, and the backward of a CUDA graph captured in the next forward (TrunkGraphs,
a new packed shape) has to sync with them: on an H200 that capture failed
(cudaErrorStreamCaptureImplicit) and the trunk's training graphs went off for the run."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.models import save_model
from pipeline.training import PolicyTrainer, TrainerConfig

from ._helpers import make_batch, make_model


def _graph_tensors() -> list[torch.Tensor]:
    """Live tensors that belong to an autograd graph (dynamo's fake tensors aside)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    return [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.grad_fn is not None
    ]


def test_no_graph_of_an_earlier_micro_batch_is_alive_at_a_forward(tmp_path: Path):
    save_model(make_model(), tmp_path / "model")
    # two mini-batches of several micro-batches each
    config = TrainerConfig(device="cpu", max_tokens_per_micro_batch=24, mini_batches=2)
    trainer = PolicyTrainer(tmp_path / "model", config, AlgorithmConfig(use_kl_loss=True))
    seen: list[list[tuple[tuple[int, ...], str]]] = []
    # alive before the step (other tests' leftovers in this process): none of its graphs
    before = {id(t) for t in _graph_tensors()}

    def before_forward(module: torch.nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}  # this forward's
            alive = [t for t in _graph_tensors() if id(t) not in before | inputs]
            seen.append([(tuple(t.shape), type(t.grad_fn).__name__) for t in alive])

    trainer.model.model.register_forward_pre_hook(before_forward)
    trainer.train_step(make_batch(seed=5, n=12))
    assert len(seen) >= 4, f"{len(seen)} training forwards: the test needs several"
    assert all(not alive for alive in seen), seen
