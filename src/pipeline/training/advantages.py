"""Batch-level advantage helpers that need no model: group baselines, KL-shaped token
rewards, and whitening with statistics over all ranks' tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.algorithms import (
    AlgorithmConfig,
    compute_vtrace,
    grpo_advantages,
    kl_penalty_rewards,
    place_on_last_token,
    rloo_advantages,
)
from pipeline.errors import ConfigError
from pipeline.training.batch import ExperienceBatch
from pipeline.training.distributed import (
    all_reduce_,
    all_reduce_ints,
    collective_device,
    is_distributed,
)


def _gather_scores(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """Every rank's (scores, group ids) concatenated in rank order, and this rank's offset."""
    if not is_distributed():
        return scores, group_ids, 0
    dev = collective_device()
    counts = _per_rank(scores.numel())
    width = max(counts)
    local = torch.zeros(2, width, dtype=torch.float64, device=dev)
    local[0, : scores.numel()] = scores.double()
    ids = torch.zeros(width, dtype=torch.int64, device=dev)
    ids[: group_ids.numel()] = group_ids
    parts = [torch.empty_like(local) for _ in counts]
    id_parts = [torch.empty_like(ids) for _ in counts]
    dist.all_gather(parts, local)
    dist.all_gather(id_parts, ids)
    all_scores = torch.cat([p[0, :c] for p, c in zip(parts, counts, strict=True)]).cpu()
    all_ids = torch.cat([p[:c] for p, c in zip(id_parts, counts, strict=True)]).cpu()
    return all_scores.to(scores.dtype), all_ids, sum(counts[: dist.get_rank()])


def _per_rank(value: int) -> list[int]:
    """One int per rank, in rank order."""
    counts = [0] * dist.get_world_size()
    counts[dist.get_rank()] = value
    return all_reduce_ints(counts, "sum")


@torch.no_grad()
def group_advantages(
    batch: ExperienceBatch, algorithm: AlgorithmConfig, *, across_ranks: bool = True
) -> ExperienceBatch:
    """GRPO / RLOO advantages from sequence scores and group ids (critic-free).

    `batch` is this rank's shard: under a process group every rank's scores are gathered
    first (a collective), so a group split across shards gets the same baseline as in the
    whole batch; group ids must agree across ranks, as the uid-hash default does. Pass
    `across_ranks=False` for a batch that already is the whole batch.
    """
    if across_ranks:
        all_scores, all_ids, offset = _gather_scores(batch.scores.float(), batch.group_ids)
    else:
        all_scores, all_ids, offset = batch.scores.float(), batch.group_ids, 0
    per_seq = torch.ones(all_scores.numel(), 1, dtype=torch.bool)  # one "token" per sample
    if algorithm.advantage_estimator == "grpo":
        adv = grpo_advantages(
            all_scores, all_ids, per_seq, norm_by_std=algorithm.norm_adv_by_std_in_grpo
        )
    elif algorithm.advantage_estimator == "rloo":
        adv = rloo_advantages(all_scores, all_ids, per_seq)
    else:
        raise ConfigError(
            f"group_advantages serves grpo/rloo, not {algorithm.advantage_estimator!r}; "
            "gae/vtrace advantages come from the critic"
        )
    local = adv[offset : offset + batch.num_samples]  # (n, 1)
    mask = batch.response_mask
    return batch.replace(advantages=torch.where(mask, local.float(), 0.0))


@torch.no_grad()
def token_rewards(
    batch: ExperienceBatch, algorithm: AlgorithmConfig, kl_coef: float
) -> tuple[Tensor, Tensor | None]:
    """(rewards (n, R), per-token KL (n, R) or None): the score on the last response token,
    minus kl_coef * KL(policy || reference) per token when the reward penalty is on.

    The policy's log-probs are the learner's (recomputed) when present, else the sampler's.
    """
    mask = batch.response_mask
    if not algorithm.kl_penalty_in_reward:
        return place_on_last_token(batch.scores.float(), mask), None
    if batch.ref_logprobs is None:
        raise ConfigError(
            "algorithm.kl_penalty_in_reward needs ref_logprobs on the batch; compute them "
            "with PolicyTrainer.ref_logprobs (or turn the penalty off)"
        )
    logp = (
        batch.learner_logprobs if batch.learner_logprobs is not None else batch.behaviour_logprobs
    )
    rewards, kl = kl_penalty_rewards(
        batch.scores.float(),
        logp,
        batch.ref_logprobs,
        mask,
        coef=kl_coef,
        estimator=algorithm.kl_reward_estimator,
    )
    return rewards, kl


@torch.no_grad()
def global_whiten(
    values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """masked_whiten with mean and (Bessel-corrected) variance over every rank's tokens, so
    a sharded batch is whitened exactly like the whole batch."""
    m = mask.bool()
    v = values.double()
    dev = collective_device()
    stats = torch.stack([m.sum().double(), torch.where(m, v, 0.0).sum()]).to(dev)
    stats = all_reduce_(stats, "sum")
    count, total = stats[0], stats[1]
    mean = (total / count.clamp_min(1)).to(values.device)
    sq = torch.where(m, (v - mean).square(), 0.0).sum().reshape(1).to(dev)
    sq = all_reduce_(sq, "sum")[0].to(values.device)
    count = count.to(values.device)
    var = sq / count.clamp_min(1)
    var = torch.where(count > 1, var * count / (count - 1).clamp_min(1), var)
    out = (v - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0).to(values.dtype)


def vtrace(
    rewards: Tensor, values: Tensor, target: Tensor, batch: ExperienceBatch, alg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """V-trace (advantages, value targets) of the batch's samples under `target` log-probs,
    its sampler's as the behaviour, with the algorithm's gamma, lambda and truncations."""
    return compute_vtrace(
        rewards,
        values,
        target,
        batch.behaviour_logprobs,
        batch.response_mask,
        gamma=alg.gamma,
        lam=alg.lam,
        rho_bar=alg.vtrace_rho_bar,
        c_bar=alg.vtrace_c_bar,
    )
