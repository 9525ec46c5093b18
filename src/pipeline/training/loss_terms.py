"""A micro-batch's policy loss and its metrics as one function of tensors, compilable.

Run op by op, the clipped surrogate, the entropy mean, the KL loss and their metrics launch
~190 small kernels a micro-batch on a GPU (~150 in the forward, ~40 in its backward, each
short and paying a launch gap), and adding each metric to the step's sums three more. Here they come back as one loss and two metric vectors:
`trainer.compile_loss` compiles the function (inductor fuses it into a few kernels each
way, shapes dynamic), and the sums take each vector in one add (`MetricSums.add_all`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.algorithms import (
    AlgorithmConfig,
    KLEstimator,
    agg_loss,
    kl_estimate,
    kl_loss,
    masked_sum,
    mismatch_metrics,
    ppo_policy_loss,
    truncated_is_weights,
)
from pipeline.training.compile_limits import allow_recompiles

MICRO_KEYS = (
    "actor/loss",
    "actor/pg_loss",
    "actor/entropy",
    "actor/clip_frac",
    "actor/clip_frac_lower",
    "actor/approx_kl",
)
KL_LOSS_KEY = "actor/kl_loss"
TOKEN_KEYS = (
    "mismatch/kl",
    "mismatch/mean_abs_diff",
    "mismatch/truncated_frac",
    "actor/is_weight_mean",
    # over the tokens that the learner's current weights sampled: numerical mismatch alone
    "mismatch/same_version_kl",
    "mismatch/same_version_tokens",
)
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k2", "k3")
KL_KEYS = tuple(f"kl/{est}" for est in KL_ESTIMATORS)

# (loss, micro-batch means (micro_keys), token sums (token_keys) or empty, max |log pi - log
# mu| or empty)
Terms = tuple[Tensor, Tensor, Tensor, Tensor]
LossFn = Callable[..., Terms]


def micro_keys(alg: AlgorithmConfig) -> tuple[str, ...]:
    """The names of `policy_loss_terms`' second output, in order."""
    return (*MICRO_KEYS, KL_LOSS_KEY) if alg.use_kl_loss else MICRO_KEYS


def token_keys(with_ref: bool) -> tuple[str, ...]:
    """The names of `token_sums`' first output, in order."""
    return (*TOKEN_KEYS, *KL_KEYS) if with_ref else TOKEN_KEYS


@torch.no_grad()
def token_sums(
    mask: Tensor,
    behaviour: Tensor,
    prox: Tensor,
    ref: Tensor | None,
    is_w: Tensor,
    alg: AlgorithmConfig,
    same_version: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(token sums of the sampler/learner mismatch and of the KL to the reference, float64
    in `token_keys` order; max |log pi - log mu|) over the valid tokens. `same_version`:
    the valid tokens that the learner's current weights sampled (None: none known)."""
    tokens = mask.sum().double()
    mm = mismatch_metrics(prox, behaviour, mask, cap=alg.is_cap, level=alg.is_level)
    same = mask.bool() & same_version.bool() if same_version is not None else None
    values = {
        "mismatch/kl": mm.kl * tokens,
        "mismatch/mean_abs_diff": mm.mean_abs_diff * tokens,
        "mismatch/truncated_frac": mm.truncated_frac * tokens,
        "actor/is_weight_mean": masked_sum(is_w, mask),
        "mismatch/same_version_kl": (
            masked_sum(kl_estimate(behaviour, prox, "k3"), same)
            if same is not None
            else tokens.new_zeros(())
        ),
        "mismatch/same_version_tokens": (
            same.sum().double() if same is not None else tokens.new_zeros(())
        ),
    }
    if ref is not None:
        for est, key in zip(KL_ESTIMATORS, KL_KEYS, strict=True):
            values[key] = masked_sum(kl_estimate(prox, ref, est), mask)
    return _stacked(values, token_keys(ref is not None)), mm.max_abs_diff


def _stacked(values: dict[str, Tensor], keys: tuple[str, ...]) -> Tensor:
    """The named scalars as one float64 vector in `keys` order (the order is the keys')."""
    return torch.stack([values[k].detach().reshape(()).to(torch.float64) for k in keys])


def policy_loss_terms(
    logp: Tensor,
    entropy: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: Tensor,
    is_w: Tensor | None,
    ref: Tensor | None,
    same_version: Tensor | None = None,
    *,
    alg: AlgorithmConfig,
) -> Terms:
    """The micro-batch's loss and metrics, all (m, r) inputs. `is_w` None: one update per
    step, so the proximal log-probs are this forward's own (detached) and `old` holds the
    behaviour log-probs: the importance weights and the token sums come from them here;
    else `old` holds the proximal log-probs and `is_w` their weights (token sums empty)."""
    empty = logp.new_zeros(0, dtype=torch.float64)
    token, top = empty, empty
    if is_w is None:
        behaviour, old = old, logp.detach().float()  # the ratio is 1, its gradient is not
        is_w = truncated_is_weights(old, behaviour, mask, cap=alg.is_cap, level=alg.is_level)
        token, top = token_sums(mask, behaviour, old, ref, is_w, alg, same_version)
    pg_loss, pg = ppo_policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_ratio_low=alg.clip_ratio_low,
        clip_ratio_high=alg.clip_ratio_high,
        clip_ratio_c=alg.clip_ratio_c,
        loss_agg_mode=alg.loss_agg_mode,
        is_weights=is_w,
    )
    entropy_mean = agg_loss(entropy, mask, alg.loss_agg_mode)
    loss = pg_loss
    if alg.entropy_coef > 0:  # otherwise entropy is only reported, never differentiated
        loss = loss - alg.entropy_coef * entropy_mean
    values = {"actor/pg_loss": pg_loss, "actor/entropy": entropy_mean, **pg.as_dict()}
    if alg.use_kl_loss:
        assert ref is not None
        kl = kl_loss(logp, ref, mask, estimator=alg.kl_estimator, loss_agg_mode=alg.loss_agg_mode)
        loss = loss + alg.kl_loss_coef * kl
        values[KL_LOSS_KEY] = kl
    values["actor/loss"] = loss
    return loss, _stacked(values, micro_keys(alg)), token, top.reshape(-1)


def loss_function(alg: AlgorithmConfig, compiled: bool) -> LossFn:
    """`policy_loss_terms` bound to the algorithm, compiled (dynamic shapes, one graph) or
    as it is."""
    fn = functools.partial(policy_loss_terms, alg=alg)
    if not compiled:
        return fn
    allow_recompiles()
    graph = torch.compile(fn, dynamic=True, fullgraph=True)

    def at_least_two(*args: Tensor | None) -> Terms:
        # a micro-batch of one sequence or of one-token responses would meet a graph that
        # the compiler specialised for size 1 (a recompile mid-run): padded rows and
        # columns are masked out, which every loss, mean and sum here leaves out. Always
        # a fresh tensor (the pad copies), so no input is a view: dynamo guards on how
        # inputs alias, which would differ between a padded and an unpadded call
        m, r = args[0].shape  # type: ignore[union-attr]
        pad = (0, max(0, 2 - r), 0, max(0, 2 - m))
        return graph(*(None if t is None else torch.nn.functional.pad(t, pad) for t in args))

    return at_least_two
