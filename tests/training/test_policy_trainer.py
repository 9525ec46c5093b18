"""PolicyTrainer on one CPU process: skipped non-finite updates, metrics, determinism,
critic-free advantages and the errors that name a fix."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from bench.learner_step import parse_variant

from pipeline.algorithms import AlgorithmConfig
from pipeline.errors import ConfigError
from pipeline.models.layers import AdjacentRows, adjacent_rows, rows_follow
from pipeline.training import BatchError, PolicyTrainer, TrainerConfig
from pipeline.training.precision import ComputeWeights

from ._helpers import TINY, assert_trained_alike, make_batch, save_tiny_model, state_of

CONFIG = TrainerConfig(device="cpu", lr=1e-3, max_tokens_per_micro_batch=30, mini_batches=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("policy") / "model")


# fused: AdamW's fused kernel (CPU has one too) clips and skips on the device, and the host
# reads the outcome after the step was queued (TrainEngine.queue_update)
# flat: bfloat16 compute with the fused AdamW runs the flat-buffer optimizer (flat_adamw.py)
FUSED = pytest.mark.parametrize(
    "fused",
    [
        {"fused_optimizer": False},
        {"fused_optimizer": True},
        {"fused_optimizer": True, "param_dtype": "bfloat16"},
    ],
    ids=["host-skip", "device-skip", "flat"],
)


def _poisoned(seed: int):
    batch = make_batch(seed=seed)
    adv = batch.advantages.clone()
    adv[3, 0] = float("nan")  # one valid token poisons the loss: the update is skipped
    return batch.replace(advantages=adv)


@FUSED
def test_nan_loss_skips_update_keeps_weights_and_adam_state_and_counts_it(
    model_dir: Path, fused: dict
):
    config = CONFIG.replace(mini_batches=1, **fused)
    trainer = PolicyTrainer(model_dir, config, AlgorithmConfig())
    before = state_of(trainer.model)
    metrics = trainer.train_step(_poisoned(0))
    assert metrics["actor/skipped_updates"] == 1
    assert metrics["actor/skipped_steps_total"] == 1 == trainer.skipped_steps
    assert math.isnan(metrics["actor/grad_norm"])  # no applied update to average
    assert trainer.engine.optimizer_steps == 0
    for state in trainer.engine.optimizer.state.values():  # Adam never saw the bad batch
        assert float(state["step"]) == 0 and not state["exp_avg"].any()
    assert all(p.grad is None for p in trainer.model.parameters())
    for name, value in state_of(trainer.model).items():
        assert torch.equal(value, before[name]), name
    good = trainer.train_step(make_batch(seed=0))  # training carries on
    assert good["actor/skipped_updates"] == 0 and trainer.engine.optimizer_steps == 1


@FUSED
def test_infinite_gradient_with_finite_loss_skips_update(model_dir: Path, fused: dict):
    trainer = PolicyTrainer(model_dir, CONFIG.replace(**fused), AlgorithmConfig())
    before = state_of(trainer.model)
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    handle = weight.register_hook(lambda g: g * float("inf"))
    metrics = trainer.train_step(make_batch(seed=1))
    handle.remove()
    assert metrics["actor/skipped_updates"] == 2 == trainer.skipped_steps  # both mini-batches
    assert math.isfinite(metrics["actor/loss"])
    for name, value in state_of(trainer.model).items():
        assert torch.equal(value, before[name]), name


def test_device_side_clip_and_schedule_update_like_the_host_side_ones(model_dir: Path):
    """Two mini-batches (two optimizer steps per train step) under a warmup schedule and a
    clip that binds: the fused kernel's device-side clip, with the schedule stepped when the
    host settles each update, leaves the weights of the host-side clip and step."""
    config = CONFIG.replace(grad_clip=0.05, schedule="linear", warmup_steps=2, total_steps=10)
    states, metrics = [], []
    for fused in (False, True):
        trainer = PolicyTrainer(model_dir, config.replace(fused_optimizer=fused), AlgorithmConfig())
        assert trainer.engine.optimizer.param_groups[0]["fused"] == fused
        for seed in (4, 5):
            m = trainer.train_step(make_batch(seed=seed))
        assert trainer.engine.optimizer_steps == 4 and m["actor/skipped_updates"] == 0
        states.append(state_of(trainer.model))
        metrics.append(m)
    assert metrics[0]["actor/grad_norm"] > 0.05  # the clip binds
    assert metrics[1]["actor/grad_norm"] == pytest.approx(metrics[0]["actor/grad_norm"], rel=1e-5)
    assert metrics[1]["actor/lr"] == metrics[0]["actor/lr"]
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_flat_optimizer_updates_like_torch_adamw_in_bf16_compute(model_dir: Path):
    """bfloat16 compute with the fused AdamW: the flat-buffer optimizer (flat_adamw.py) against
    torch's per-parameter kernel, over 4 optimizer steps with a binding clip and warmup."""
    config = CONFIG.replace(
        param_dtype="bfloat16",
        fused_optimizer=True,
        grad_clip=0.05,
        schedule="linear",
        warmup_steps=2,
        total_steps=10,
    )
    states, norms = [], []
    for flat in (False, True):
        trainer = PolicyTrainer(model_dir, config.replace(flat_optimizer=flat), AlgorithmConfig())
        for seed in (4, 5):
            metrics = trainer.train_step(make_batch(seed=seed))
        engine = trainer.engine
        assert (engine._flat is not None and not engine._flat.disabled) == flat
        assert engine.optimizer_steps == 4 and metrics["actor/skipped_updates"] == 0
        states.append(state_of(trainer.model))
        norms.append(metrics["actor/grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-5) and norms[0] > 0.05
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _overwrite_pending(weights: ComputeWeights) -> Callable[..., None]:
    """A forward pre-hook that zeroes pending gradients, as a CUDA graph replay would."""

    def hook(*_: object) -> None:
        for g in weights.pending_grads() or []:
            g.zero_()

    return hook


def test_pending_gradients_are_safe_from_the_next_micro_batch_forward(model_dir: Path):
    """The flat optimizer reads one micro-batch's bf16 gradients in place; they may be CUDA
    graph outputs, which the next replay overwrites. Simulated here: each trunk forward zeroes
    whatever is still pending. With several micro-batches per update (max 30 tokens) the
    engine must have moved them to float32 first: training equals the torch optimizer's."""
    config = CONFIG.replace(param_dtype="bfloat16", fused_optimizer=True, grad_clip=0.05)
    states = []
    for flat in (False, True):
        trainer = PolicyTrainer(model_dir, config.replace(flat_optimizer=flat), AlgorithmConfig())
        weights = trainer.engine._compute
        assert weights is not None
        trainer.model.model.register_forward_pre_hook(_overwrite_pending(weights))
        for seed in (4, 5):
            trainer.train_step(make_batch(seed=seed))
        assert (trainer.engine._flat is not None and not trainer.engine._flat.disabled) == flat
        states.append(state_of(trainer.model))
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_step_reports_losses_kl_per_estimator_mismatch_and_throughput(model_dir: Path):
    config = CONFIG.replace(peak_flops=1e12)
    trainer = PolicyTrainer(model_dir, config, AlgorithmConfig(use_kl_loss=True))
    batch = make_batch(seed=2)
    metrics = trainer.train_step(batch)
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/clip_frac",
        "actor/grad_norm",
        "actor/lr",
        "kl/k1",
        "kl/k2",
        "kl/k3",
        "mismatch/kl",
        "mismatch/mean_abs_diff",
        "perf/tokens_per_s",
        "perf/mfu",
    ):
        assert math.isfinite(metrics[key]), key
    # before the first update the policy is the reference: every KL estimate is 0
    assert metrics["kl/k1"] == metrics["kl/k2"] == metrics["kl/k3"] == 0.0
    learner = trainer.compute_logprobs(batch)
    assert learner.shape == batch.behaviour_logprobs.shape
    assert trainer.train_step(batch)["kl/k3"] > 0
    assert metrics["perf/tokens"] == sum(batch.seq_lengths)
    assert "perf/mfu" not in PolicyTrainer(model_dir, CONFIG).train_step(batch)


def test_step_reports_the_seconds_of_each_of_its_phases(model_dir: Path):
    trainer = PolicyTrainer(model_dir, CONFIG, AlgorithmConfig(use_kl_loss=True))
    batch = make_batch(seed=2)
    metrics = trainer.train_step(batch)  # the reference forward runs here: none on the batch
    phases = ("perf/reference_s", "perf/proximal_s", "perf/update_s")
    assert all(metrics[k] > 0 for k in phases), metrics
    assert sum(metrics[k] for k in phases) <= metrics["perf/step_time_s"] + 1e-3
    # reference log-probs on the batch (a reference service computed them): no such phase
    given = batch.replace(ref_logprobs=trainer.ref_logprobs(batch))
    assert "perf/reference_s" not in trainer.train_step(given)


def test_two_runs_with_same_seed_are_bitwise_identical(model_dir: Path):
    config = CONFIG.replace(shuffle=True, ppo_epochs=2)
    states, losses = [], []
    for _ in range(2):
        trainer = PolicyTrainer(model_dir, config, AlgorithmConfig(entropy_coef=0.01))
        losses.append([trainer.train_step(make_batch(seed=s))["actor/loss"] for s in range(2)])
        states.append(state_of(trainer.model))
    assert losses[0] == losses[1]
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name


def test_grpo_advantages_are_computed_in_trainer_without_critic(model_dir: Path):
    trainer = PolicyTrainer(model_dir, CONFIG, AlgorithmConfig(advantage_estimator="grpo"))
    before = state_of(trainer.model)
    metrics = trainer.train_step(make_batch(seed=3, advantages=False))
    assert metrics["actor/skipped_updates"] == 0
    assert any(not torch.equal(v, before[n]) for n, v in state_of(trainer.model).items())


def test_missing_advantages_or_reference_raise_errors_that_name_the_fix(model_dir: Path):
    trainer = PolicyTrainer(model_dir, CONFIG, AlgorithmConfig())
    with pytest.raises(BatchError, match="compute_advantages"):
        trainer.train_step(make_batch(seed=0, advantages=False))
    with pytest.raises(ConfigError, match="keep_reference"):
        trainer.ref_logprobs(make_batch(seed=0))


def test_fused_proximal_forward_gives_the_update_of_a_separate_one(tmp_path):
    """One optimizer step per update: the training forward's detached log-probs are the
    proximal log-probs, so skipping the separate no-grad forward changes nothing but time."""
    model_dir = save_tiny_model(tmp_path / "m")
    algorithm = AlgorithmConfig(use_kl_loss=True, entropy_coef=0.01, is_cap=1.5)
    base = TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=40)
    results = {}
    for fused in (True, False):
        trainer = PolicyTrainer(model_dir, base.replace(fuse_proximal=fused), algorithm)
        metrics = [trainer.train_step(make_batch(seed=s)) for s in (1, 2)]
        results[fused] = (state_of(trainer.model), metrics)
    (w_fused, m_fused), (w_sep, m_sep) = results[True], results[False]
    # the separate forward packs its micro-batches otherwise: its log-probs round otherwise
    start = state_of(PolicyTrainer(model_dir, base, algorithm).model)
    assert_trained_alike(w_fused, w_sep, start, lr=base.lr, updates=2)
    for a, b in zip(m_fused, m_sep, strict=True):
        for key in ("actor/pg_loss", "mismatch/kl", "mismatch/mean_abs_diff", "kl/k3",
                    "actor/is_weight_mean", "mismatch/truncated_frac"):  # fmt: skip
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert m_fused[0]["mismatch/kl"] > 0  # behaviour log-probs differ: not a trivial pass


def test_fused_rope_trains_identically(model_dir: Path):
    """trainer.fused_rope swaps in the rope_qkv op (its torch formula on CPU): it trains like
    the plain rotation (assert_trained_alike), and every attention layer runs it."""
    states = []
    for fused in (False, True):
        trainer = PolicyTrainer(model_dir, CONFIG.replace(fused_rope=fused), AlgorithmConfig())
        layers = trainer.model.model.layers
        assert [layer.self_attn.fused_rope for layer in layers] == [fused] * len(layers)
        for seed in (3, 4):
            trainer.train_step(make_batch(seed=seed))
        states.append(state_of(trainer.model))
    start = state_of(PolicyTrainer(model_dir, CONFIG, AlgorithmConfig()).model)
    assert_trained_alike(states[1], states[0], start, lr=CONFIG.lr, updates=4)


def test_fused_norm_trains_identically(model_dir: Path):
    """trainer.fused_norm moves every residual add into the next norm's op (its torch formula
    on CPU): it trains like the separate add and norm (assert_trained_alike), with
    activation checkpointing too, and the trunk and every block run it."""
    states = []
    for fused, checkpointing in ((False, False), (True, False), (True, True)):
        config = CONFIG.replace(fused_norm=fused, activation_checkpointing=checkpointing)
        trainer = PolicyTrainer(model_dir, config, AlgorithmConfig())
        trunk = trainer.model.model
        assert [trunk.fused_norm, *(b.fused_norm for b in trunk.layers)] == [fused] * (
            1 + len(trunk.layers)
        )
        trainer.train_step(make_batch(seed=3))
        states.append(state_of(trainer.model))
    start = state_of(PolicyTrainer(model_dir, CONFIG, AlgorithmConfig()).model)
    for other in states[1:]:
        assert_trained_alike(other, states[0], start, lr=CONFIG.lr, updates=2)


@pytest.mark.parametrize(
    "precision",
    [{}, {"param_dtype": "bfloat16", "fused_optimizer": True}],
    ids=["float32", "bf16-flat"],
)
def test_tied_gradient_rows_train_identically(model_dir: Path, precision: dict):
    """trainer.tied_grad_rows (on by default in one process; the tiny policy is tied): it
    trains like the dense embedding gradient, in float32 and in bf16 compute with the flat
    optimizer reading the pending gradients. The two sum a repeated token's rows in another
    order (in bf16, torch's CPU embedding backward sums them in bf16, the rows path in
    float32 as inductor's does on CUDA), so a few weights (0.1 % in a probe) differ by up to
    a step (assert_trained_alike). A dropped embedding gradient moves 80 % of the table's
    weights, and 15 % of all, by more than a tenth of a step (checked). The frozen
    reference keeps the plain lookup."""
    states = []
    for rows in (False, True):
        config = CONFIG.replace(tied_grad_rows=rows, keep_reference=True, **precision)
        trainer = PolicyTrainer(model_dir, config, AlgorithmConfig(use_kl_loss=True))
        assert trainer.model.tied_grad_rows == rows
        assert trainer.reference is not None and not trainer.reference.model.tied_grad_rows
        for seed in (3, 4):
            trainer.train_step(make_batch(seed=seed))
        states.append(state_of(trainer.model))
    start = state_of(PolicyTrainer(model_dir, CONFIG, AlgorithmConfig()).model)
    assert_trained_alike(states[1], states[0], start, lr=CONFIG.lr, updates=4)
    embed = (states[1]["model.embed_tokens.weight"] - states[0]["model.embed_tokens.weight"]).abs()
    assert (embed > 0.1 * CONFIG.lr).float().mean() < 0.02


def test_packed_mlp_trains_identically(model_dir: Path):
    """trainer.packed_mlp: gate and up as one GEMM over their concatenated weights and the
    swiglu_packed op (its torch formula on CPU): trains like two GEMMs and F.silu over 4
    updates (float32; each parameter has its own storage, so the weights are copied
    together). Not to 1e-6 per weight: see assert_trained_alike."""
    states = []
    for packed in (False, True):
        trainer = PolicyTrainer(model_dir, CONFIG.replace(packed_mlp=packed), AlgorithmConfig())
        mlps = [layer.mlp for layer in trainer.model.model.layers]
        assert [(m.packed, m.adjacent) for m in mlps] == [(packed, False)] * len(mlps)
        for seed in (3, 4):
            trainer.train_step(make_batch(seed=seed))
        states.append(state_of(trainer.model))
    # one GEMM over gate and up sums their products in another order than two GEMMs
    start = state_of(PolicyTrainer(model_dir, CONFIG, AlgorithmConfig()).model)
    assert_trained_alike(states[1], states[0], start, lr=CONFIG.lr, updates=4)


# biases of 128 and 64 entries: multiples of the flat buffers' alignment, so they lie back to
# back there too (TINY's 32 and 16 do not)
ALIGNED_BIASES = TINY.replace(hidden_size=128, intermediate_size=96, head_dim=32)


@pytest.mark.parametrize("aligned", [False, True], ids=["tiny", "aligned-biases"])
def test_packed_mlp_and_qkv_view_adjacent_weights_of_the_flat_buffers(
    model_dir: Path, tmp_path: Path, aligned: bool
):
    """With the flat optimizer (bf16 compute) gate's and up's masters and compute copies are
    adjacent views of its buffers, and so are q's, k's and v's weights (and their biases
    where their sizes keep the buffer's alignment): the engine marks those MLPs and
    attentions `adjacent`, and the concatenations are then views of them (AdjacentRows)
    that train bit for bit like the copies (adjacent forced off); a model whose weights
    are not adjacent is not marked."""
    if aligned:
        model_dir = save_tiny_model(tmp_path / "model", ALIGNED_BIASES)
    config = CONFIG.replace(packed_mlp=True, param_dtype="bfloat16", fused_optimizer=True)
    states = []
    for adjacent in (True, False):
        trainer = PolicyTrainer(model_dir, config, AlgorithmConfig())
        mlps = [layer.mlp for layer in trainer.model.model.layers]
        attns = [layer.self_attn for layer in trainer.model.model.layers]
        assert attns[0].q_proj.bias is not None  # qwen2: the biases are grouped too
        assert all(m.adjacent for m in mlps + attns)
        assert all(a.adjacent_bias == aligned for a in attns)
        with trainer.engine.compute_weights():
            assert all(rows_follow(m.gate_proj.weight, m.up_proj.weight) for m in mlps)
            for a, kind in itertools.product(attns, ("weight", "bias")):
                q, k, v = (getattr(p, kind) for p in (a.q_proj, a.k_proj, a.v_proj))
                follow = rows_follow(q, k) and rows_follow(k, v)
                assert follow == (kind == "weight" or aligned), kind
            assert mlps[0].gate_proj.weight.dtype == torch.bfloat16
        for m in mlps + attns:
            m.adjacent = adjacent
        for a in attns:
            a.adjacent_bias = adjacent and aligned
        for seed in (3, 4):
            trainer.train_step(make_batch(seed=seed))
        states.append(state_of(trainer.model))
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, atol=0, rtol=0, msg=name)
    plain = PolicyTrainer(model_dir, config.replace(flat_optimizer=False), AlgorithmConfig())
    layers = plain.model.model.layers
    assert not any(layer.mlp.adjacent or layer.self_attn.adjacent for layer in layers)


def test_a_bfloat16_first_moment_trains_close_to_float32_and_needs_the_flat_optimizer(
    model_dir: Path,
):
    """trainer.exp_avg_dtype = "bfloat16": the flat optimizer keeps Adam's first moment in
    bfloat16 (the state the checkpoint sees too); 4 updates land close to the float32
    moment's (within 2 % of how far the weights moved) but not on them. Without the flat
    optimizer it is a config error that names the fix."""
    config = CONFIG.replace(param_dtype="bfloat16", fused_optimizer=True)
    start = state_of(PolicyTrainer(model_dir, config, AlgorithmConfig()).model)
    states = []
    for dtype in ("float32", "bfloat16"):
        trainer = PolicyTrainer(model_dir, config.replace(exp_avg_dtype=dtype), AlgorithmConfig())
        state = trainer.engine.optimizer.state
        for seed in (3, 4):
            trainer.train_step(make_batch(seed=seed))
        moments = {state[p]["exp_avg"].dtype for p in trainer.model.parameters()}
        assert moments == {getattr(torch, dtype)}
        states.append(state_of(trainer.model))
    diff = torch.cat([(states[1][k] - v).abs().flatten() for k, v in states[0].items()])
    moved = torch.cat([(v - start[k]).abs().flatten() for k, v in states[0].items()])
    assert 0 < diff.mean() < 0.02 * moved.mean()
    with pytest.raises(ConfigError, match="exp_avg_dtype = 'bfloat16' needs the flat optim"):
        PolicyTrainer(model_dir, CONFIG.replace(exp_avg_dtype="bfloat16"), AlgorithmConfig())
    with pytest.raises(ConfigError, match="exp_avg_dtype to float32 or bfloat16"):
        CONFIG.replace(exp_avg_dtype="float16")


def test_compile_modes_and_which_replay_cuda_graphs():
    assert not CONFIG.cuda_graphs  # not compiled
    for mode, graphs in (("default", False), ("reduce-overhead", True), ("max-autotune", True)):
        assert CONFIG.replace(compile=True, compile_mode=mode).cuda_graphs == graphs
    with pytest.raises(ConfigError, match="max-autotune"):
        CONFIG.replace(compile_mode="fastest")


def test_compile_options_join_the_mode_and_bad_ones_fail_when_the_trainer_builds():
    # sizes are symbolic from the first compile (compile_dynamic, on by default)
    assert CONFIG.replace(compile_mode="reduce-overhead").compile_kwargs() == {
        "mode": "reduce-overhead",
        "dynamic": True,
    }
    options = {"triton.mix_order_reduction": False, "triton.enable_pdl": True}
    kwargs = CONFIG.replace(
        compile_mode="reduce-overhead", compile_options=options
    ).compile_kwargs()
    # torch.compile takes a mode or options: the mode's own options come along
    assert kwargs == {"options": {"triton.cudagraphs": True, **options}, "dynamic": True}
    static = CONFIG.replace(compile_options=options, compile_dynamic=False)
    assert static.compile_kwargs() == {"options": options, "dynamic": None}
    assert CONFIG.replace(compile_backend="aot_eager").compile_kwargs() == {
        "backend": "aot_eager",
        "dynamic": True,
    }
    with pytest.raises(ConfigError, match="configure inductor"):
        CONFIG.replace(compile_backend="aot_eager", compile_mode="reduce-overhead")
    # checked where the trainer builds its compiled regions (the launcher imports no torch)
    with pytest.raises(ConfigError, match=r"'triton\.mix_order' is not an inductor option"):
        CONFIG.replace(compile=True, compile_options={"triton.mix_order": False}).compile_kwargs()
    with pytest.raises(ConfigError, match=r"triton\.enable_pdl takes a bool"):
        CONFIG.replace(compile=True, compile_options={"triton.enable_pdl": "yes"}).compile_kwargs()
    # as TOML gives it (the learner bench's --set)
    table = '{ "triton.mix_order_reduction" = false, "triton.enable_pdl" = true }'
    config = CONFIG.replace(**parse_variant(f"compile=true,compile_options={table}"))
    assert config.compile_options == options


@FUSED
def test_submitted_steps_read_late_train_like_train_step(model_dir: Path, fused: dict):
    """Steps submitted before the previous step's metrics are read (as the bench's
    consecutive timing and a pipelined loop run them) give the weights, counters and
    metrics of blocking train_step calls, across a skipped update under a warmup schedule:
    the next update must settle the skipped one before it reads the schedule's lr."""
    config = CONFIG.replace(
        mini_batches=1, schedule="linear", warmup_steps=3, total_steps=10, **fused
    )
    batches = [make_batch(seed=4), _poisoned(5), make_batch(seed=6), make_batch(seed=7)]
    blocking = PolicyTrainer(model_dir, config, AlgorithmConfig())
    expected = [blocking.train_step(b) for b in batches]
    assert [m["actor/skipped_updates"] for m in expected] == [0, 1, 0, 0]

    trainer = PolicyTrainer(model_dir, config, AlgorithmConfig())
    first = trainer.submit_step(batches[0])
    second = trainer.submit_step(batches[1])
    got = [first.result()]
    third = trainer.submit_step(batches[2])
    fourth = trainer.submit_step(batches[3])
    got += [fourth.result(), second.result(), third.result()]  # in any order
    got = [got[0], got[2], got[3], got[1]]
    assert fourth.done() and fourth.result() is got[3]  # read once, then kept
    for want, have in zip(expected, got, strict=True):
        for key, value in want.items():
            if not key.startswith("perf/"):
                assert have[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key
    assert [m["actor/step"] for m in got] == [1, 2, 3, 4]
    assert trainer.engine.optimizer_steps == blocking.engine.optimizer_steps == 3
    assert trainer.skipped_steps == blocking.skipped_steps == 1
    assert trainer.engine.lr == blocking.engine.lr
    for name, value in state_of(blocking.model).items():
        assert torch.equal(state_of(trainer.model)[name], value), name


def test_a_checkpoint_after_an_unread_step_settles_it_first(model_dir: Path, tmp_path: Path):
    """Saving right after submit_step (metrics never read) records the step's outcome:
    the skipped count and the schedule a resume continues from."""
    config = CONFIG.replace(mini_batches=1, fused_optimizer=True, schedule="linear",
                            warmup_steps=3, total_steps=10)  # fmt: skip
    trainer = PolicyTrainer(model_dir, config, AlgorithmConfig())
    trainer.submit_step(make_batch(seed=4))
    trainer.submit_step(_poisoned(5))  # skipped on the device, not yet read
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = PolicyTrainer(model_dir, config, AlgorithmConfig())
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 2 and resumed.skipped_steps == 1
    assert resumed.engine.optimizer_steps == 1 and resumed.engine.lr == trainer.engine.lr


def test_adjacent_rows_refuses_tensors_that_are_not_adjacent():
    a, b = torch.zeros(3, 4), torch.zeros(2, 4)
    assert not rows_follow(a, b)
    with pytest.raises(ValueError, match="not stored one after the other"):
        AdjacentRows.apply(a, b)
    flat = torch.arange(24.0, requires_grad=False)
    a, b = flat[:12].view(3, 4), flat[12:20].view(2, 4)
    assert rows_follow(a, b) and not rows_follow(b, a)
    both = AdjacentRows.apply(a, b)
    assert both.data_ptr() == a.data_ptr() and torch.equal(both, torch.cat([a, b]))
    c = flat[20:24].view(1, 4)
    with pytest.raises(ValueError, match="not stored one after the other"):
        adjacent_rows([a, c, b])
    three = adjacent_rows([a, b, c])
    assert three.data_ptr() == a.data_ptr() and torch.equal(three, flat.view(6, 4))
    # the gradient splits back by rows
    leaves = flat.clone().requires_grad_()
    views = [leaves[:12].view(3, 4), leaves[12:20].view(2, 4), leaves[20:].view(1, 4)]
    adjacent_rows(views).mul(torch.arange(6.0)[:, None]).sum().backward()
    assert torch.equal(leaves.grad, torch.arange(6.0).repeat_interleave(4))


@pytest.mark.parametrize("mini_batches", [1, 2], ids=["fused-proximal", "separate-proximal"])
def test_same_version_mismatch_counts_only_the_tokens_the_current_weights_sampled(
    model_dir: Path, mini_batches: int
):
    """Half the samples come from the learner's current weights (version 3, the learner's
    own log-probs as the sampler's), half from version 2 (other log-probs): the mismatch
    over all tokens mixes in the older ones' drift, the same-version one is numerical."""
    trainer = PolicyTrainer(model_dir, CONFIG.replace(mini_batches=mini_batches))
    batch = make_batch(seed=4)
    own = trainer.compute_logprobs(batch)
    current = (torch.arange(batch.num_samples) % 2 == 0)[:, None]  # (n, 1)
    mask = batch.response_mask
    batch = batch.replace(
        behaviour_logprobs=torch.where(current, own, batch.behaviour_logprobs),
        token_versions=torch.where(current & mask, 3, 2),
    )
    metrics = trainer.submit_step(batch, version=3).result()
    same = (current & mask).sum().item() / mask.sum().item()
    assert metrics["mismatch/same_version_frac"] == pytest.approx(same)
    assert metrics["mismatch/same_version_kl"] < 1e-9
    assert metrics["mismatch/kl"] > 1e-2
    # a version that sampled nothing in the batch: no same-version figure, a zero share
    metrics = trainer.submit_step(batch, version=5).result()
    assert "mismatch/same_version_kl" not in metrics
    assert metrics["mismatch/same_version_frac"] == 0.0


@pytest.mark.parametrize(
    "options",
    [
        {"mini_batches": 1},
        {"mini_batches": 2},
        {"mini_batches": 2, "fused_optimizer": True, "param_dtype": "bfloat16"},
    ],
    ids=["fused-proximal", "separate-proximal", "flat-bf16"],
)
def test_lagged_check_scores_the_previous_versions_tokens_with_its_weights(
    model_dir: Path, options: dict
):
    """Staleness 1: the engine sampled with version 0's weights, the learner holds version
    1's. Every step a check (mismatch_check_every 1): the weights of version 0 were kept,
    so its tokens measure numerical mismatch only, while the mismatch against the current
    weights shows the update's drift; the check leaves the update as it was."""
    config = CONFIG.replace(lr=1e-2, **options)
    checked = PolicyTrainer(model_dir, config.replace(mismatch_check_every=1))
    plain = PolicyTrainer(model_dir, config.replace(mismatch_check_every=0))
    first = make_batch(seed=5)
    second = make_batch(seed=6)
    for trainer in (checked, plain):
        trainer.submit_step(first, version=0).result()
    # version 0's log-probs of the second batch, as the engine would have them
    fresh = PolicyTrainer(model_dir, config)
    engine = fresh.compute_logprobs(second)
    second = second.replace(behaviour_logprobs=engine)
    got = checked.submit_step(second, version=1).result()
    assert got["mismatch/same_version_frac"] == pytest.approx(1.0)
    assert got["mismatch/same_version_kl"] < 1e-9
    assert got["mismatch/kl"] > 1e-4
    assert got["perf/lagged_check_s"] > 0
    base = plain.submit_step(second, version=1).result()
    assert "mismatch/same_version_kl" not in base
    assert base["mismatch/kl"] == pytest.approx(got["mismatch/kl"], rel=1e-6)
    a, b = state_of(checked.model), state_of(plain.model)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the weights came back bit for bit


def test_an_on_policy_step_runs_no_lagged_forward(model_dir: Path):
    """Staleness 0: every token is of the current version, so the kept weights have
    nothing to score; the step runs no second forward."""
    trainer = PolicyTrainer(model_dir, CONFIG.replace(mismatch_check_every=1))
    batch = make_batch(seed=5)
    trainer.submit_step(batch, version=0, on_policy=True).result()
    current = batch.replace(token_versions=torch.ones_like(batch.token_versions))
    metrics = trainer.submit_step(current, version=1, on_policy=True).result()
    assert "perf/lagged_check_s" not in metrics
    assert metrics["mismatch/same_version_frac"] == pytest.approx(1.0)
