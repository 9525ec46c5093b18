"""trainer.trunk_graphs (training/trunk_graphs.py): the configuration it needs, the calls it
leaves to the trunk, and on CUDA the graphed forward and backward against the trunk's own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.models import CausalLM, ModelConfig
from pipeline.models.attention import AttentionSpec
from pipeline.training import TrainerConfig
from pipeline.training.trunk_graphs import TrunkGraphs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    attention_bias=True,
)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"compile": True, "compile_mode": "reduce-overhead"}, "compile_mode"),
        ({"compile": True, "compile_mode": "max-autotune"}, "compile_mode"),
        ({"padding_free": False}, "padding_free"),
        ({"pack_bucket_tokens": 0}, "pack_bucket_tokens"),
    ],
)
def test_trunk_graphs_rejects_what_it_cannot_capture(changes, names):
    base = {"trunk_graphs": True, "pack_bucket_tokens": 64}
    with pytest.raises(ConfigError, match=names):
        TrainerConfig(**{**base, **changes}).validate()
    # the same settings without trunk graphs are fine
    TrainerConfig(**{**base, **changes, "trunk_graphs": False}).validate()


def _train_shapes(runner: TrunkGraphs) -> list[tuple[Any, ...]]:
    """(input shape, cu_seqlens entries, max_seqlen, grouped) of each captured training pair."""
    return [key[:4] for key in runner._graphs]


def _forward_shapes(runner: TrunkGraphs) -> list[tuple[Any, ...]]:
    """The same of each captured no-grad forward."""
    return [key[:4] for key in runner._forwards]


def _packed_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = [37, 50, 41]  # 128 tokens: one bucket of 64 * 2
    ids = torch.randint(0, CONFIG.vocab_size, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 37, 87, 128, 128], dtype=torch.long)
    return ids.to(device), positions.to(device), cu.to(device)


def test_calls_it_cannot_replay_go_back_to_the_trunk():
    """On CPU, or without gradients, the runner answers None and the trunk runs as usual."""
    model = CausalLM(CONFIG)
    graphs = TrunkGraphs(model.model)
    ids, positions, cu = _packed_inputs("cpu")
    spec = AttentionSpec(cu_seqlens=cu, max_seqlen=64)
    assert graphs(ids, positions, spec) is None  # not CUDA
    with torch.no_grad():
        assert graphs(ids, positions, spec) is None
    assert graphs.replays == 0 and _train_shapes(graphs) == []
    model.packed_runner = graphs
    plain = CausalLM(CONFIG)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(
        model.hidden_states_packed(ids, positions, cu, 64),
        plain.hidden_states_packed(ids, positions, cu, 64),
    )


@pytest.mark.gpu
@needs_cuda
def test_graphed_trunk_matches_the_trunk_in_value_and_gradient_and_replays():
    torch.manual_seed(0)
    plain = CausalLM(CONFIG).to("cuda", torch.bfloat16)
    graphed = CausalLM(CONFIG).to("cuda", torch.bfloat16)
    graphed.load_state_dict(plain.state_dict())
    graphed.tie_weights()
    runner = TrunkGraphs(graphed.model)
    graphed.packed_runner = runner
    ids, positions, cu = _packed_inputs("cuda")
    g = torch.Generator().manual_seed(1)
    for step in range(3):  # capture, then replays with new inputs and output gradients
        ids = torch.randint(0, CONFIG.vocab_size, ids.shape, generator=g).to("cuda")
        upstream = torch.randn(1, 128, CONFIG.hidden_size, generator=g).to("cuda", torch.bfloat16)
        outs = []
        for model in (plain, graphed):
            model.zero_grad(set_to_none=True)
            hidden = model.hidden_states_packed(ids, positions, cu, 64)
            hidden.backward(upstream)
            grads = [p.grad.float() for p in model.model.parameters()]  # the trunk's
            outs.append([hidden.detach().float(), *grads])
        for a, b in zip(*outs, strict=True):
            err = (a - b).abs().max().item() / max(1e-3, a.abs().max().item())
            assert err < 2e-2, (step, err)
    assert runner.replays == 3 and len(_train_shapes(runner)) == 1 and runner.fallbacks == 0
    runner.no_grad = False
    with torch.no_grad():  # no forward graphs asked for: the trunk runs itself
        graphed.hidden_states_packed(ids, positions, cu, 64)
    assert runner.replays == 3 and _forward_shapes(runner) == []


@pytest.mark.gpu
@needs_cuda
def test_no_grad_forwards_replay_their_own_graphs_and_match_the_trunk():
    """The reference's and the proximal policy's forwards: one forward-only graph per shape,
    each output its own tensor (a later replay does not overwrite an earlier output)."""
    torch.manual_seed(0)
    plain = CausalLM(CONFIG).to("cuda", torch.bfloat16).eval()
    graphed = CausalLM(CONFIG).to("cuda", torch.bfloat16).eval()
    graphed.load_state_dict(plain.state_dict())
    runner = TrunkGraphs(graphed.model, train=False)
    graphed.packed_runner = runner
    _, positions, cu = _packed_inputs("cuda")
    g = torch.Generator().manual_seed(1)
    outs = []
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, CONFIG.vocab_size, (1, 128), generator=g).to("cuda")
            want = plain.hidden_states_packed(ids, positions, cu, 64)
            outs.append((want, graphed.hidden_states_packed(ids, positions, cu, 64)))
    for want, got in outs:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert outs[0][1].data_ptr() != outs[1][1].data_ptr()
    assert runner.replays == 3 and len(_forward_shapes(runner)) == 1 and _train_shapes(runner) == []
    graphed.train()  # a trunk that does not train: no training graphs
    graphed.hidden_states_packed(ids, positions, cu, 64)
    assert runner.replays == 3


def _train_pass(model: CausalLM, ids, positions, cu, *, uniform: bool = False) -> None:
    model.zero_grad(set_to_none=True)
    hidden = model.hidden_states_packed(ids, positions, cu, 64, uniform)
    hidden.float().square().mean().backward()


@pytest.mark.gpu
@needs_cuda
def test_a_shape_is_captured_after_the_trunk_trained_itself():
    """A uniform micro-batch (rows attention) trains on the trunk itself, outside the graphs;
    a later new varlen shape must still capture (the learner's warm-up meets both)."""
    torch.manual_seed(0)
    model = CausalLM(CONFIG).to("cuda", torch.bfloat16)
    model.uniform_attention = True
    runner = TrunkGraphs(model.model)
    model.packed_runner = runner
    _, positions, cu = _packed_inputs("cuda")
    ids = torch.randint(0, CONFIG.vocab_size, (1, 128), device="cuda")
    rows_pos = torch.arange(64, device="cuda").repeat(2)[None]
    rows_cu = torch.tensor([0, 64, 128], device="cuda")
    _train_pass(model, ids, rows_pos, rows_cu, uniform=True)  # the trunk itself
    assert runner.replays == 0
    _train_pass(model, ids, positions, cu)  # captured now
    _train_pass(model, ids, positions, cu)
    torch.cuda.synchronize()
    assert runner.replays == 2 and len(_train_shapes(runner)) == 1


@pytest.mark.gpu
@needs_cuda
def test_a_training_shape_is_captured_after_a_no_grad_forward_graph():
    """The proximal policy's no-grad forward is captured on the policy's own trunk before
    its first training micro-batch."""
    torch.manual_seed(0)
    model = CausalLM(CONFIG).to("cuda", torch.bfloat16)
    runner = TrunkGraphs(model.model)
    model.packed_runner = runner
    ids, positions, cu = _packed_inputs("cuda")
    with torch.no_grad():
        model.hidden_states_packed(ids, positions, cu, 64)
    _train_pass(model, ids, positions, cu)
    _train_pass(model, ids, positions, cu)
    torch.cuda.synchronize()
    assert len(_forward_shapes(runner)) == 1 and len(_train_shapes(runner)) == 1
    assert runner.replays == 3


@pytest.mark.gpu
@needs_cuda
def test_the_learner_warm_up_of_the_h200_profile_captures_every_training_shape(tmp_path):
    """The learner's warm-up as `pipeline run` does it, on the H200 profile's settings and
    step sizes (a small model): on an H200 the KL-PPO cold start's learner failed its second
    batch's first training capture (cudaErrorStreamCaptureImplicit) and crash-looped."""
    from bench.e2e import shape_model

    from pipeline.config.profile import load_config, parse_override_args
    from pipeline.training import PolicyTrainer
    from pipeline.training.config import policy_config
    from pipeline.training.warm_up import warm_up_batches

    overrides = shape_model("tiny", tmp_path / "model", "cuda")
    config = load_config("profiles/h200-single.toml", parse_override_args(overrides))
    trainer = PolicyTrainer(str(tmp_path / "model"), policy_config(config), config.algorithm)
    runner = trainer.model.packed_runner
    assert isinstance(runner, TrunkGraphs)
    trainer.warm_up(warm_up_batches(config, trainer.model.config.vocab_size))
    torch.cuda.synchronize()
    assert runner.capture_failures == 0 and runner.train
    assert len(_train_shapes(runner)) >= 2 and runner.replays > 0
