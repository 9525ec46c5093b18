"""What the trainers of a run are built from: the run config's settings for the policy,
the reference and the value model, and a step's batch from its sample groups. Shared by
the learner, critic and reference services (none imports another's service code)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pipeline.config import PipelineConfig
from pipeline.training.config import TrainerConfig

if TYPE_CHECKING:
    from pipeline.samples import GroupArrays
    from pipeline.training import ExperienceBatch


def policy_config(config: PipelineConfig) -> TrainerConfig:
    """The learner's trainer settings, with the sampler's temperature (PPO ratios and the
    mismatch metrics compare log-probs of the distribution the engine actually sampled;
    greedy engines report temperature-1 log-probs) and a reference model only when the
    reference is hosted in the learner."""
    temperature = config.rollout.temperature or 1.0
    return dataclasses.replace(
        config.learner.trainer,
        temperature=temperature,
        keep_reference=config.reference_host() == "learner",
    )


def reference_config(config: PipelineConfig, device: str) -> TrainerConfig:
    """The reference's forward: the policy's settings (same temperature, packing and
    precision, so its log-probs compare with the learner's) on the host's device."""
    return dataclasses.replace(policy_config(config), device=device, keep_reference=False)


def batch_from_groups(groups: list[GroupArrays]) -> ExperienceBatch:
    """The samples of groups as an ExperienceBatch, in a fixed (uid) order, with every
    per-token field that all samples carry."""
    import numpy as np

    from pipeline.training import ExperienceBatch
    from pipeline.training.batch import OPTIONAL_TOKEN_FIELDS

    samples = sorted(((g, s) for g in groups for s in g.samples), key=lambda pair: pair[1].uid)
    optional: dict[str, list[Any]] = {}
    for name in OPTIONAL_TOKEN_FIELDS:
        if samples and all(name in s.extra for _, s in samples):
            optional[name] = [np.asarray(s.extra[name], np.float32) for _, s in samples]
    return ExperienceBatch.from_lists(
        [np.asarray(g.prompt_ids, np.int64) for g, _ in samples],
        [np.asarray(s.response_ids, np.int64) for _, s in samples],
        [np.asarray(s.behaviour_logprobs, np.float32) for _, s in samples],
        [float(s.score) for _, s in samples],
        uids=[s.uid for _, s in samples],
        token_versions=[np.asarray(s.token_versions, np.int64) for _, s in samples],
        **optional,
    )


def group_stats(groups: list[GroupArrays]) -> dict[str, float]:
    """Each stage's per-group measurements (`GroupArrays.stats`), averaged over groups."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for group in groups:
        for key, value in group.stats.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
