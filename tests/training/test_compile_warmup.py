"""A compiled trainer warmed up before its first batch compiles nothing more, whatever the
lengths of the batches that follow, and the warm-up trains nothing (aot_eager on CPU: the
same dynamo frames and guards as inductor, no kernels generated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import CriticTrainer, PolicyTrainer, TrainerConfig

from ._helpers import make_batch, save_tiny_model, state_of

COMPILED = TrainerConfig(
    device="cpu",
    lr=1e-3,
    max_tokens_per_micro_batch=64,
    mini_batches=2,
    padding_free=True,
    compile=True,
    compile_backend="aot_eager",
    compile_scope="blocks",
    compile_loss=True,
)
# the warm-up's lengths: all sequences alike, and mixed
WARM = [
    {"seed": 100, "prompt_len": (4, 5), "response_len": (6, 7)},
    {"seed": 101, "prompt_len": (2, 8), "response_len": (1, 10)},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("warm") / "model")


def _frames() -> tuple[int, int, int]:
    """Frames dynamo tried and compiled, and graphs it made (the compiled loss, a partial,
    counts no frame: only its graphs show it)."""
    return counters["frames"]["total"], counters["frames"]["ok"], counters["stats"]["unique_graphs"]


def test_a_warmed_up_policy_trainer_never_recompiles_and_the_warm_up_trains_nothing(model_dir):
    torch._dynamo.reset()
    counters.clear()
    trainer = PolicyTrainer(model_dir, COMPILED, AlgorithmConfig(use_kl_loss=True))
    before = state_of(trainer.model)
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    seconds = trainer.warm_up([make_batch(n=8, **w) for w in WARM])
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG is where it was
    assert seconds > 0 and trainer.step == 0 and trainer.skipped_steps == 0
    assert trainer.engine.optimizer_steps == 0
    for name, value in state_of(trainer.model).items():
        assert torch.equal(value, before[name]), name
    for state in trainer.engine.optimizer.state.values():  # Adam never saw the warm-up
        assert not state or not state["exp_avg"].any()
    warm = _frames()
    assert warm[0] == warm[1] > 0 and warm[2] > warm[1]  # trunk and loss, nothing eager
    for step in range(6):  # new packed lengths, numbers of sequences and longest sequences
        n = 6 + 2 * step
        metrics = trainer.train_step(make_batch(seed=step, n=n, response_len=(1, 3 + 3 * step)))
        assert metrics["actor/skipped_updates"] == 0
    # sequences all alike again, of another length and number than the warm-up's
    trainer.train_step(make_batch(seed=9, n=10, prompt_len=(3, 4), response_len=(9, 10)))
    assert _frames() == warm, "a step recompiled after the warm-up"
    assert trainer.step == 7


def test_without_the_warm_up_the_first_step_compiles(model_dir):
    torch._dynamo.reset()
    counters.clear()
    trainer = PolicyTrainer(model_dir, COMPILED, AlgorithmConfig())
    assert _frames() == (0, 0, 0)
    trainer.train_step(make_batch(seed=0, n=8))
    assert _frames()[1] > 0


def test_a_warmed_up_critic_never_recompiles(model_dir):
    torch._dynamo.reset()
    counters.clear()
    critic = CriticTrainer(model_dir, COMPILED.replace(lr=1e-4), AlgorithmConfig())
    critic.warm_up([make_batch(n=8, advantages=False, **w) for w in WARM])
    assert critic.step == 0 and critic.skipped_steps == 0
    warm = _frames()
    assert warm[0] == warm[1] > 0
    for step in range(4):
        batch, _ = critic.compute_advantages(
            make_batch(seed=step, n=6 + 2 * step, advantages=False, response_len=(1, 4 + step))
        )
        assert critic.train_step(batch)["critic/skipped_updates"] == 0
    assert _frames() == warm


def test_warm_up_batches_cover_micro_batches_that_fill_whole_buckets(model_dir):
    """Issue 30: a 50-step H200 run recompiled the critic at step 16, when a micro-batch's
    sequences all had one length and filled whole buckets (the uniform attention path,
    which the warm-up's batches never took). The run's own warm-up batches now do."""
    from pipeline.config import load_config
    from pipeline.training.warm_up import warm_up_batches

    config = load_config(
        "profiles/local-cpu.toml",
        {
            "task.max_prompt_tokens": "5",
            "rollout.max_new_tokens": "10",
            "controller.prompts_per_step": "2",
            "rollout.n_samples": "4",
        },
    )
    bucketed = COMPILED.replace(lr=1e-4, pack_bucket_tokens=16)
    for role in ("critic", "policy"):
        torch._dynamo.reset()
        counters.clear()
        if role == "critic":
            trainer = CriticTrainer(model_dir, bucketed, AlgorithmConfig())
        else:
            trainer = PolicyTrainer(model_dir, bucketed, AlgorithmConfig())
        trainer.warm_up(warm_up_batches(config, 64))
        warm = _frames()
        # 4 sequences of 8 tokens a mini-batch: 32 tokens, two whole buckets
        batch = make_batch(seed=3, n=8, prompt_len=(4, 5), response_len=(4, 5))
        if role == "critic":
            batch, _ = trainer.compute_advantages(batch.replace(advantages=None))
        trainer.train_step(batch)
        assert _frames() == warm, f"the {role} compiled a bucket-filling micro-batch mid-run"
