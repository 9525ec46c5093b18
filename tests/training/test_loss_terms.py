"""The micro-batch loss as one function (training/loss_terms.py): its vectors name the same
values as the algorithms' functions called one by one, compiled it equals eager (dynamic
shapes, one graph), and MetricSums takes a vector as the per-key adds would."""

from __future__ import annotations

import pytest
import torch

from pipeline.algorithms import (
    AlgorithmConfig,
    agg_loss,
    kl_estimate,
    kl_loss,
    masked_sum,
    mismatch_metrics,
    ppo_policy_loss,
    truncated_is_weights,
)
from pipeline.training.loss_terms import (
    loss_function,
    micro_keys,
    policy_loss_terms,
    token_keys,
)
from pipeline.training.metrics import MetricSums, MetricVector

ALG = AlgorithmConfig(
    advantage_estimator="grpo",
    use_kl_loss=True,
    kl_loss_coef=0.05,
    entropy_coef=0.01,
    loss_agg_mode="seq-mean-token-mean",
    clip_ratio_c=3.0,
    is_cap=1.5,
)


def _inputs(m: int, r: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(m, r, generator=g) > 0.3
    mask[0] = m == 1  # a sample without valid tokens (unless it is the only one)
    mask[-1, 0] = True  # and one with
    behaviour = -2 + 0.5 * torch.randn(m, r, generator=g)
    return {
        "logp": (behaviour + 0.3 * torch.randn(m, r, generator=g)).requires_grad_(),
        "entropy": (1 + torch.rand(m, r, generator=g)).requires_grad_(),
        "mask": mask,
        "adv": torch.randn(m, r, generator=g),
        "behaviour": behaviour,
        "ref": behaviour + 0.2 * torch.randn(m, r, generator=g),
        # sampled by the learner's current weights: every other sample
        "same": (torch.arange(m) % 2 == 0)[:, None].expand(m, r).clone(),
    }


def _expected(x: dict[str, torch.Tensor], alg: AlgorithmConfig) -> tuple[torch.Tensor, dict]:
    """The fused micro-batch loss and metrics by the algorithms' functions, one by one."""
    mask, ref = x["mask"], x["ref"]
    prox = x["logp"].detach()
    is_w = truncated_is_weights(prox, x["behaviour"], mask, cap=alg.is_cap)
    pg_loss, pg = ppo_policy_loss(
        x["logp"], prox, x["adv"], mask, clip_ratio_c=alg.clip_ratio_c,
        loss_agg_mode=alg.loss_agg_mode, is_weights=is_w,
    )  # fmt: skip
    ent = agg_loss(x["entropy"], mask, alg.loss_agg_mode)
    kl = kl_loss(x["logp"], ref, mask, estimator=alg.kl_estimator, loss_agg_mode=alg.loss_agg_mode)
    loss = pg_loss - alg.entropy_coef * ent + alg.kl_loss_coef * kl
    tokens = mask.sum().double()
    mm = mismatch_metrics(prox, x["behaviour"], mask, cap=alg.is_cap)
    values = {
        "actor/loss": loss, "actor/pg_loss": pg_loss, "actor/entropy": ent,
        "actor/clip_frac": pg.clip_frac, "actor/clip_frac_lower": pg.clip_frac_lower,
        "actor/approx_kl": pg.approx_kl, "actor/kl_loss": kl,
        "mismatch/kl": mm.kl * tokens, "mismatch/mean_abs_diff": mm.mean_abs_diff * tokens,
        "mismatch/truncated_frac": mm.truncated_frac * tokens,
        "actor/is_weight_mean": masked_sum(is_w, mask),
        "mismatch/same_version_kl": masked_sum(
            kl_estimate(x["behaviour"], prox, "k3"), mask & x["same"]
        ),
        "mismatch/same_version_tokens": (mask & x["same"]).sum(),
        **{f"kl/{e}": masked_sum(kl_estimate(prox, ref, e), mask) for e in ("k1", "k2", "k3")},
        "max": mm.max_abs_diff,
    }  # fmt: skip
    return loss, {k: float(v.detach()) for k, v in values.items()}


def _named(terms: tuple[torch.Tensor, ...], alg: AlgorithmConfig) -> dict[str, float]:
    _, micro, token, top = terms
    out = dict(zip(micro_keys(alg), micro.tolist(), strict=True))
    out.update(zip(token_keys(True), token.tolist(), strict=True))
    out["max"] = float(top[0])
    return out


def test_loss_terms_name_the_values_of_the_algorithms_functions() -> None:
    x = _inputs(6, 9, seed=0)
    terms = policy_loss_terms(
        x["logp"], x["entropy"], x["mask"], x["adv"], x["behaviour"], None, x["ref"], x["same"],
        alg=ALG,
    )  # fmt: skip
    loss, expected = _expected(x, ALG)
    got = _named(terms, ALG)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert float(terms[0].detach()) == pytest.approx(float(loss.detach()), rel=1e-6)
    assert micro_keys(AlgorithmConfig(use_kl_loss=False))[-1] == "actor/approx_kl"
    # decoupled: proximal log-probs and weights given, no token sums
    prox = x["behaviour"] + 0.1
    is_w = truncated_is_weights(prox, x["behaviour"], x["mask"], cap=ALG.is_cap)
    loss2, _, token, top = policy_loss_terms(
        x["logp"], x["entropy"], x["mask"], x["adv"], prox, is_w, x["ref"], alg=ALG
    )
    assert token.numel() == 0 and top.numel() == 0
    pg_loss, _ = ppo_policy_loss(
        x["logp"], prox, x["adv"], x["mask"], clip_ratio_c=ALG.clip_ratio_c,
        loss_agg_mode=ALG.loss_agg_mode, is_weights=is_w,
    )  # fmt: skip
    assert float(loss2.detach()) != pytest.approx(float(terms[0].detach()), rel=1e-3)
    ent = agg_loss(x["entropy"], x["mask"], ALG.loss_agg_mode)
    kl = kl_loss(x["logp"], x["ref"], x["mask"], estimator=ALG.kl_estimator,
                 loss_agg_mode=ALG.loss_agg_mode)  # fmt: skip
    want = pg_loss - ALG.entropy_coef * ent + ALG.kl_loss_coef * kl
    assert float(loss2.detach()) == pytest.approx(float(want.detach()), rel=1e-6)


def test_compiled_loss_terms_equal_eager_across_shapes() -> None:
    """Any (sequences, response length), one graph: a micro-batch of one sequence or of
    one-token responses (padded to two, masked out) compiles nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = loss_function(ALG, compiled=False), loss_function(ALG, compiled=True)
    shapes = ((6, 9, 1), (4, 13, 2), (7, 5, 3), (1, 9, 4), (5, 1, 5), (1, 1, 6))
    for m, r, seed in shapes:  # shapes vary: dynamic, no break
        runs = []
        for fn in (eager, compiled):
            x = _inputs(m, r, seed)
            terms = fn(x["logp"], x["entropy"], x["mask"], x["adv"], x["behaviour"], None,
                       x["ref"], x["same"])  # fmt: skip
            terms[0].backward()
            runs.append((_named(terms, ALG), x["logp"].grad, x["entropy"].grad))
        (a, ga, ea), (b, gb, eb) = runs
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, m, r)
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(eb, ea, rtol=1e-5, atol=1e-7)
        assert ga.abs().sum() > 0 and ea.abs().sum() > 0
    assert counters["stats"]["unique_graphs"] == 1


def test_metric_sums_add_a_vector_as_the_per_key_adds() -> None:
    keys = ("b", "a", "c")
    values = torch.tensor([1.5, -2.0, 4.0])
    one, other = MetricSums(["a", "b", "c", "d"]), MetricSums(["a", "b", "c", "d"])
    one.add_all(MetricVector(keys, values), scale=0.5)
    one.add_all(MetricVector(keys[:1], values[:1]))
    for key, value in zip(keys, values, strict=True):
        other.add(key, value * 0.5)
    other.add("b", values[0])
    assert one.reduce() == other.reduce() == {"a": -1.0, "b": 2.25, "c": 2.0, "d": 0.0}
    with pytest.raises(KeyError, match="'e'"):
        one.add_all(MetricVector(("a", "e"), values[:2]))


@pytest.mark.gpu
def test_metric_sums_add_a_device_vector_in_one_index_add() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    sums = MetricSums(["a", "b", "c"], device=device)
    sums.add_all(MetricVector(("c", "a"), torch.tensor([3.0, 1.0], device=device)), scale=2.0)
    sums.add_all(MetricVector(("c", "a"), torch.tensor([1.0, 1.0], device=device)))
    sums.add("b", 0.25)
    assert sums.reduce() == {"a": 3.0, "b": 0.25, "c": 7.0}
