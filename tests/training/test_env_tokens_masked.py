"""Environment tokens get no gradient: multi-turn samples (policy turns with the environment's
observations between them, `loss_mask` 0 on the latter) go through `batch_from_groups` into
one real PolicyTrainer update; changing any per-token field at masked positions leaves the
updated weights bit for bit as they were, while changing it at one policy token does not.

Token ids are not perturbed: an environment token is context for the policy tokens after
it, so its id rightly changes their log-probs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import PolicyTrainer, TrainerConfig
from pipeline.training.batch import ExperienceBatch
from pipeline.wire.samples import GroupArrays, SampleArrays

from ._helpers import save_tiny_model, state_of

VOCAB = 64
GROUPS, SAMPLES = 2, 4
VERSION = 3  # the policy tokens' versions are VERSION or VERSION - 1

# (algorithm, trainer, per-token extras the samples carry)
CASES = {
    # proximal log-probs from a forward of their own; behaviour ones in the IS weights
    "grpo": (
        AlgorithmConfig(advantage_estimator="grpo"),
        TrainerConfig(mini_batches=2),
        (),
    ),
    # fused proximal: the behaviour log-probs are the loss's old log-probs; sequence IS
    "grpo-fused-seq-is": (
        AlgorithmConfig(
            advantage_estimator="grpo", is_level="sequence", loss_agg_mode="seq-mean-token-mean"
        ),
        TrainerConfig(mini_batches=1, fuse_proximal=True, padding_free=False),
        (),
    ),
    # the critic's advantages (whitened over valid tokens) and a KL loss to the reference
    "gae-kl": (
        AlgorithmConfig(advantage_estimator="gae", use_kl_loss=True, kl_loss_coef=0.5),
        TrainerConfig(mini_batches=2),
        ("advantages", "ref_logprobs"),
    ),
    # V-trace from the critic's values and token rewards: masked tokens are jumped over
    "vtrace": (
        AlgorithmConfig(advantage_estimator="vtrace", loss_agg_mode="seq-mean-token-sum"),
        TrainerConfig(mini_batches=1),
        ("values", "rewards", "advantages"),
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("policy") / "model")


def episodes(extras: tuple[str, ...], seed: int = 0) -> list[GroupArrays]:
    """Groups of multi-turn samples: policy turn, observation, policy turn (, observation
    cut by the token budget), with behaviour log-probs 0 and the previous token's version on
    the observation tokens, as EpisodeDriver writes them."""
    g = np.random.default_rng(seed)
    groups = []
    for p in range(GROUPS):
        samples = []
        for i in range(SAMPLES):
            turns = [(int(g.integers(1, 5)), 1.0), (int(g.integers(1, 5)), 0.0)]
            turns += [(int(g.integers(1, 5)), 1.0)]
            if i % 2:
                turns.append((int(g.integers(1, 3)), 0.0))
            mask = np.concatenate([np.full(n, m, np.float32) for n, m in turns])
            n = len(mask)
            policy = mask > 0
            versions = np.where(np.arange(n) < n // 2, VERSION - 1, VERSION).astype(np.int32)
            behaviour = np.where(policy, -np.log(VOCAB) + 0.3 * g.standard_normal(n), 0.0)
            extra = {"loss_mask": mask}
            for name in extras:
                extra[name] = g.standard_normal(n).astype(np.float32)
                if name == "ref_logprobs":
                    extra[name] = (behaviour + 0.2 * extra[name]).astype(np.float32)
            samples.append(
                SampleArrays(
                    uid=f"p{p}/{i}",
                    response_ids=g.integers(0, VOCAB, n).astype(np.int32),
                    behaviour_logprobs=behaviour.astype(np.float32),
                    token_versions=versions,
                    finish_reason="stop" if i % 2 == 0 else "length",
                    score=float(g.random()),
                    extra=extra,
                )
            )
        prompt = g.integers(0, VOCAB, int(g.integers(2, 6))).astype(np.int32)
        groups.append(GroupArrays(uid=f"p{p}", prompt_ids=prompt, samples=samples))
    return groups


def perturbed(groups: list[GroupArrays], where: str, seed: int = 1) -> list[GroupArrays]:
    """A copy with every per-token field changed at the masked positions ("masked"), or
    the behaviour log-prob and every extra changed at one policy token ("policy")."""
    g = np.random.default_rng(seed)
    out = []
    for group in groups:
        samples = []
        for s in group.samples:
            masked = s.extra["loss_mask"] == 0
            if where == "masked":
                at = masked
            else:
                at = np.zeros_like(masked)
                if s.uid == "p1/2":
                    at[np.flatnonzero(~masked)[-1]] = True  # its last policy token
            n = int(at.sum())
            behaviour = s.behaviour_logprobs.copy()
            behaviour[at] = g.uniform(-20.0, -0.1, n)
            versions = s.token_versions.copy()
            versions[at] = g.integers(VERSION - 1, VERSION + 1, n)  # within the staleness bound
            extra = {k: v.copy() for k, v in s.extra.items()}
            for name, value in extra.items():
                if name != "loss_mask":
                    value[at] = g.uniform(-5.0, 5.0, n)
            samples.append(
                SampleArrays(
                    uid=s.uid,
                    response_ids=s.response_ids.copy(),
                    behaviour_logprobs=behaviour,
                    token_versions=versions,
                    finish_reason=s.finish_reason,
                    score=s.score,
                    extra=extra,
                )
            )
        out.append(GroupArrays(uid=group.uid, prompt_ids=group.prompt_ids, samples=samples))
    return out


def update(model_dir: Path, case: str, groups: list[GroupArrays]):
    """Weights and loss metrics after one update of a fresh trainer on the groups."""
    algorithm, trainer, _ = CASES[case]
    config = trainer.replace(device="cpu", lr=1e-2, max_tokens_per_micro_batch=24)
    policy = PolicyTrainer(model_dir, config, algorithm)
    metrics = policy.train_step(ExperienceBatch.from_groups(groups))
    assert metrics["actor/skipped_updates"] == 0
    losses = {
        k: v
        for k, v in metrics.items()
        if k.split("/")[0] in ("actor", "mismatch", "kl", "vtrace") and "seconds" not in k
    }
    return state_of(policy.model), losses


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


def test_the_loss_mask_becomes_the_response_mask() -> None:
    groups = episodes(("advantages",))
    batch = ExperienceBatch.from_groups(groups)
    samples = sorted((s for g in groups for s in g.samples), key=lambda s: s.uid)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert batch.response_mask[i, :n].tolist() == (s.extra["loss_mask"] > 0).tolist()
        assert not batch.response_mask[i, n:].any()
    assert batch.advantages is not None


@pytest.mark.parametrize("case", list(CASES))
def test_masked_tokens_fields_do_not_change_the_update(model_dir: Path, case: str) -> None:
    groups = episodes(CASES[case][2])
    start = state_of(PolicyTrainer(model_dir, TrainerConfig(device="cpu"), CASES[case][0]).model)
    weights, losses = update(model_dir, case, groups)
    assert differing(start, weights), "the update changed nothing"
    again, again_losses = update(model_dir, case, groups)
    assert not differing(weights, again) and losses == again_losses  # deterministic
    masked, masked_losses = update(model_dir, case, perturbed(groups, "masked"))
    assert not differing(weights, masked), "an environment token's fields reached the update"
    assert masked_losses == losses
    # the control: the same kind of change at one policy token moves the weights
    control, _ = update(model_dir, case, perturbed(groups, "policy"))
    assert differing(weights, control), "a policy token's fields do not reach the update"
    # and without the loss mask, the environment's tokens are trained on
    unmasked = [
        GroupArrays(
            uid=group.uid,
            prompt_ids=group.prompt_ids,
            samples=[
                SampleArrays(
                    uid=s.uid,
                    response_ids=s.response_ids,
                    behaviour_logprobs=s.behaviour_logprobs,
                    token_versions=s.token_versions,
                    score=s.score,
                    extra={k: v for k, v in s.extra.items() if k != "loss_mask"},
                )
                for s in group.samples
            ],
        )
        for group in groups
    ]
    assert differing(weights, update(model_dir, case, unmasked)[0])


@pytest.mark.parametrize("padding_free", [True, False])
def test_a_mini_batch_of_only_failed_episodes_trains(model_dir: Path, padding_free: bool) -> None:
    """Episodes whose environment failed at reset have empty responses; a mini-batch of
    only those used to kill the learner ("element 0 of tensors does not require grad")."""
    groups = episodes(())
    empty = [
        SampleArrays(
            uid=f"p9/{i}",
            response_ids=np.zeros(0, np.int32),
            behaviour_logprobs=np.zeros(0, np.float32),
            token_versions=np.zeros(0, np.int32),
            finish_reason="env_error",
            extra={"loss_mask": np.zeros(0, np.float32)},
        )
        for i in range(SAMPLES)
    ]
    groups.append(GroupArrays(uid="p9", prompt_ids=np.arange(4, dtype=np.int32), samples=empty))
    config = TrainerConfig(device="cpu", mini_batches=3, padding_free=padding_free)
    trainer = PolicyTrainer(model_dir, config, AlgorithmConfig(advantage_estimator="grpo"))
    start = state_of(trainer.model)
    metrics = trainer.train_step(ExperienceBatch.from_groups(groups))  # p9's samples sort last
    assert metrics["actor/skipped_updates"] == 0 and np.isfinite(metrics["actor/loss"])
    after = state_of(trainer.model)
    assert differing(start, after) and all(torch.isfinite(t).all() for t in after.values())
