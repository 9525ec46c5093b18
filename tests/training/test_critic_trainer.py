"""Critic: values, KL-shaped rewards -> GAE against an independent float64 NumPy reference,
V-trace, whitening, and value regression."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algorithms import AlgorithmConfig, make_kl_controller
from pipeline.models import ValueModel
from pipeline.training import CriticTrainer, TrainerConfig

from ._helpers import TINY, make_batch


def _critic(algorithm: AlgorithmConfig) -> CriticTrainer:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = ValueModel(TINY)
        model.init_weights(std=0.2)
        torch.nn.init.normal_(model.score.weight, std=0.5)  # non-zero values to bootstrap on
    return CriticTrainer(
        model, TrainerConfig(device="cpu", lr=1e-2, max_tokens_per_micro_batch=25), algorithm
    )


def _numpy_gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """Textbook GAE on one unpadded response: delta_t = r_t + gamma V_{t+1} - V_t."""
    adv = np.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


def test_gae_with_kl_shaped_rewards_equals_float64_numpy_reference():
    algorithm = AlgorithmConfig(
        gamma=0.97,
        lam=0.9,
        whiten_advantages=False,
        kl_penalty_in_reward=True,
        kl_reward_estimator="k1",
        init_kl_coef=0.2,
    )
    critic = _critic(algorithm)
    batch = make_batch(seed=4, n=7, advantages=False)
    noise = 0.2 * torch.randn(
        batch.behaviour_logprobs.shape, generator=torch.Generator().manual_seed(5)
    )
    ref = torch.where(batch.response_mask, batch.behaviour_logprobs + noise, 0.0)
    batch = batch.replace(ref_logprobs=ref)
    kl_ctrl = make_kl_controller(algorithm)

    out, metrics = critic.compute_advantages(batch, kl_ctrl)

    values = critic.compute_values(batch)
    torch.testing.assert_close(out.values, values)
    assert metrics["kl/coef"] == 0.2
    for i in range(batch.num_samples):
        n = int(batch.response_lengths[i])
        behaviour = batch.behaviour_logprobs[i, :n].double().numpy()
        rewards = -0.2 * (behaviour - ref[i, :n].double().numpy())  # k1 penalty per token
        rewards[-1] += float(batch.scores[i])  # the score lands on the last token
        v = values[i, :n].double().numpy()
        adv = _numpy_gae(rewards, v, gamma=0.97, lam=0.9)
        np.testing.assert_allclose(out.advantages[i, :n].numpy(), adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.returns[i, :n].numpy(), adv + v, rtol=1e-5, atol=1e-5)
        assert not out.advantages[i, n:].any()

    # the adaptive-free fixed controller keeps its value; the reported KL is the k1 token mean
    mask = batch.response_mask
    k1 = ((batch.behaviour_logprobs - batch.ref_logprobs) * mask).sum() / mask.sum()
    assert metrics["kl/reward_kl"] == pytest.approx(float(k1), rel=1e-5)


def test_whitened_advantages_have_zero_mean_unit_variance_over_valid_tokens():
    critic = _critic(AlgorithmConfig(whiten_advantages=True))
    out, _ = critic.compute_advantages(make_batch(seed=2, advantages=False))
    valid = out.advantages[out.response_mask].double()
    assert abs(float(valid.mean())) < 1e-6
    assert float(valid.std()) == pytest.approx(1.0, rel=1e-5)
    assert not out.advantages[~out.response_mask].any()


def test_vtrace_equals_gae_when_on_policy_and_without_target_logprobs_gives_lambda_returns():
    """With the target's log-probs V-trace weighs the tokens (on policy: GAE's returns);
    without them (the pipeline's critic) the returns are GAE's lambda-returns, the token
    rewards are on the batch for the learner's V-trace, and off-policy targets differ."""
    vtrace = _critic(
        AlgorithmConfig(advantage_estimator="vtrace", lam=1.0, whiten_advantages=False)
    )
    gae = _critic(AlgorithmConfig(advantage_estimator="gae", lam=1.0, whiten_advantages=False))
    batch = make_batch(seed=6, advantages=False)
    g_plain, _ = gae.compute_advantages(batch)
    v_plain, _ = vtrace.compute_advantages(batch)
    torch.testing.assert_close(v_plain.returns, g_plain.returns)
    assert v_plain.rewards is not None
    torch.testing.assert_close(v_plain.rewards.sum(dim=1), batch.scores)
    on_policy = batch.replace(learner_logprobs=batch.behaviour_logprobs.clone())
    v_out, _ = vtrace.compute_advantages(on_policy)
    g_out, _ = gae.compute_advantages(on_policy)
    torch.testing.assert_close(v_out.returns, g_out.returns, atol=1e-5, rtol=1e-5)
    off = batch.replace(learner_logprobs=batch.behaviour_logprobs - 0.5)
    v_off, _ = vtrace.compute_advantages(off)
    assert (v_off.returns - g_out.returns)[batch.response_mask].abs().max() > 1e-3


def test_critic_train_steps_reduce_value_error_on_fixed_returns():
    critic = _critic(AlgorithmConfig(value_clip=None, whiten_advantages=False))
    batch, _ = critic.compute_advantages(make_batch(seed=7, advantages=False))
    first = critic.train_step(batch)
    for _ in range(15):
        last = critic.train_step(batch)
    assert last["critic/value_loss"] < 0.5 * first["critic/value_loss"]
    assert last["critic/skipped_updates"] == 0
    assert critic.step == 16
