"""The critic: per-token values, KL-shaped rewards -> GAE / V-trace advantages, value updates.

Owns a ValueModel (FSDP2 when distributed) started from a reward/value checkpoint or from a
causal-LM checkpoint (zero value head). `compute_advantages` is what the pipeline's critic
service runs on each scored batch before the learner trains on it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.algorithms import (
    AlgorithmConfig,
    KLController,
    clipped_value_loss,
    compute_gae,
    masked_mean,
    masked_sum,
)
from pipeline.errors import ConfigError
from pipeline.models import ValueModel
from pipeline.models.hf_causal import HFModule, load_for_training
from pipeline.training.advantages import global_whiten, token_rewards, vtrace
from pipeline.training.batch import ExperienceBatch
from pipeline.training.checkpoint import LoadedCheckpoint
from pipeline.training.config import TrainerConfig
from pipeline.training.distributed import DistInfo, current_dist_info
from pipeline.training.engine import TrainEngine, perf_metrics
from pipeline.training.errors import BatchError
from pipeline.training.forward import micro_values, no_grad_plan
from pipeline.training.metrics import MetricSums
from pipeline.training.micro_batching import MicroBatch
from pipeline.training.transformers_path import for_transformers


def _load_value_model(
    model: str | os.PathLike[str] | ValueModel, config: TrainerConfig
) -> ValueModel:
    """The native ValueModel or a value head on transformers' trunk (HFValueModel)."""
    if isinstance(model, torch.nn.Module):
        return model
    loaded = load_for_training(
        model, value_head=True, implementation=config.implementation, role="critic"
    )
    return loaded  # type: ignore[return-value]


class CriticTrainer:
    """Value model + optimizer; computes advantages and trains on returns."""

    def __init__(
        self,
        model: str | os.PathLike[str] | ValueModel,
        config: TrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        dist: DistInfo | None = None,
    ) -> None:
        self.config = config or TrainerConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        self.config.validate()
        self.algorithm.validate()
        self.info = dist or current_dist_info(self.config.device)
        value_model = _load_value_model(model, self.config)
        if isinstance(value_model, HFModule):
            self.config = for_transformers(self.config)
        self.engine = TrainEngine(value_model, self.config, self.info, name="critic")

    @property
    def model(self) -> ValueModel:
        return self.engine.model  # type: ignore[return-value]

    @property
    def step(self) -> int:
        return self.engine.train_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @torch.no_grad()
    def compute_values(self, batch: ExperienceBatch) -> Tensor:
        """V(prompt + response[:t]) for each response token t, (n, R) float32, 0 if masked."""
        out = torch.zeros(batch.num_samples, batch.max_response_len)  # (n, R)
        with self.engine.compute_weights():
            for mb in no_grad_plan(batch, self.config):
                self.engine.begin_forward()
                values, _ = micro_values(self.model, mb.to(self.info.device))
                if mb.is_empty:
                    continue
                mask = mb.fields(batch.response_mask)
                mb.put(out, torch.where(mask, values.float().cpu(), 0.0))
        return out

    @torch.no_grad()
    def compute_advantages(
        self, batch: ExperienceBatch, kl_ctrl: KLController | None = None
    ) -> tuple[ExperienceBatch, dict[str, float]]:
        """Fill values, token rewards, advantages and returns; update `kl_ctrl` with the
        batch's KL.

        Rewards: the score on the last response token, minus kl_ctrl.value * KL(policy ||
        ref) per token when algorithm.kl_penalty_in_reward. Then GAE; or V-trace when the
        batch has the target policy's `learner_logprobs`. Without them (the pipeline's
        critic: only the learner has the current policy) V-trace's returns are GAE's
        lambda-returns, the value model's target, and the learner computes the V-trace
        advantages from `values` and `rewards`. Whitening uses every rank's tokens.
        Existing `batch.values` are used as they are (no recompute).
        """
        alg = self.algorithm
        mask = batch.response_mask
        values = batch.values if batch.values is not None else self.compute_values(batch)
        coef = kl_ctrl.value if kl_ctrl is not None else alg.init_kl_coef
        rewards, kl = token_rewards(batch, alg, coef)  # (n, R)
        if alg.advantage_estimator == "vtrace" and batch.learner_logprobs is not None:
            adv, returns = vtrace(rewards, values, batch.learner_logprobs, batch, alg)
        elif alg.advantage_estimator in ("gae", "vtrace"):
            adv, returns = compute_gae(rewards, values, mask, gamma=alg.gamma, lam=alg.lam)
        else:
            raise ConfigError(
                f"advantage_estimator={alg.advantage_estimator!r} needs no critic; compute "
                "group advantages with pipeline.training.group_advantages"
            )
        raw_adv = adv.float()
        if alg.whiten_advantages:
            adv = global_whiten(adv, mask)
        keys = ["samples", "tokens", "score", "reward", "values", "returns", "advantages"]
        if kl is not None:
            keys += ["kl_tokens", "kl_seq_sum", "kl_seqs"]
        sums = MetricSums(keys)
        has_tokens = mask.bool().any(dim=-1)
        sums.add("samples", float(batch.num_samples))
        sums.add("tokens", mask.sum().double())
        sums.add("score", batch.scores.double().sum())
        sums.add("reward", masked_sum(rewards.double(), mask))
        sums.add("values", masked_sum(values.double(), mask))
        sums.add("returns", masked_sum(returns.double(), mask))
        sums.add("advantages", masked_sum(raw_adv.double(), mask))
        if kl is not None:
            sums.add("kl_tokens", masked_sum(kl.double(), mask))
            sums.add("kl_seq_sum", masked_sum(masked_mean(kl.double(), mask, dim=-1), has_tokens))
            sums.add("kl_seqs", has_tokens.sum().double())
        g = sums.reduce()
        tokens, samples = max(g["tokens"], 1.0), max(g["samples"], 1.0)
        metrics = {
            "critic/score_mean": g["score"] / samples,
            "critic/reward_mean": g["reward"] / tokens,
            "critic/values_mean": g["values"] / tokens,
            "critic/returns_mean": g["returns"] / tokens,
            "critic/advantages_mean": g["advantages"] / tokens,
            "kl/coef": coef,
        }
        if kl is not None:
            seq_kl = g["kl_seq_sum"] / max(g["kl_seqs"], 1.0)
            metrics["kl/reward_kl"] = g["kl_tokens"] / tokens
            metrics["kl/reward_seq_kl"] = seq_kl
            # what the penalty took off the rewards, per token
            metrics["kl/reward_penalty"] = coef * g["kl_tokens"] / tokens
            if kl_ctrl is not None:
                kl_ctrl.update(seq_kl, int(g["samples"]))
                metrics["kl/coef_next"] = kl_ctrl.value
        out = batch.replace(
            values=values.float(),
            advantages=adv.float(),
            returns=returns.float(),
            rewards=rewards.float(),
        )
        return out, metrics

    def warm_up(self, batches: list[ExperienceBatch]) -> float:
        """Compile and capture what the critic runs (values without grad, a value update)
        on each batch, with every sample's first return NaN so that no update is applied
        (each mini-batch's loss is non-finite); counters and RNG
        as before. Returns the seconds it took."""
        start = time.perf_counter()
        with self.engine.warming_up():
            for batch in batches:
                values = self.compute_values(batch)
                returns = values.clone()
                returns[:, 0] = float("nan")
                self.train_step(batch.replace(values=values, returns=returns))
        return time.perf_counter() - start

    def train_step(self, batch: ExperienceBatch) -> dict[str, float]:
        """Clipped value regression on `batch.returns` (old values: `batch.values`)."""
        start = time.perf_counter()
        if batch.values is None or batch.returns is None:
            raise BatchError("critic train_step needs values and returns (compute_advantages)")
        alg = self.algorithm
        keys = ["critic/value_loss", "critic/clip_frac", "critic/values", "critic/abs_error"]
        sums = MetricSums([*keys, "perf/tokens"], device=self.info.device)

        def micro_loss(
            dev: MicroBatch, host: MicroBatch
        ) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
            named = {"mask": batch.response_mask, "returns": batch.returns, "old": batch.values}
            values, anchor = micro_values(self.model, dev)
            if host.is_empty:
                return None, anchor, {}
            # (m, r) each, copied while the device runs the forward (see MicroBatch.fields_to)
            f = host.fields_to(self.info.device, named)
            mask, returns = f["mask"], f["returns"]
            loss, vm = clipped_value_loss(
                values,
                f["old"],
                returns,
                mask,
                clip_range=alg.value_clip,
                loss_agg_mode=alg.loss_agg_mode,
            )
            with torch.no_grad():
                metrics = {
                    "critic/value_loss": loss.detach(),
                    "critic/clip_frac": vm.clip_frac,
                    "critic/values": masked_mean(values, mask),
                    "critic/abs_error": masked_mean((values - returns).abs(), mask),
                }
            return loss, anchor, metrics

        stats = self.engine.run_epochs(batch, alg.loss_agg_mode, micro_loss, sums)
        sums.add("perf/tokens", float(stats.local_tokens))
        self.engine.train_steps += 1
        raw = self.engine.read_step(stats, sums)
        updates = max(stats.updates, 1)
        out: dict[str, Any] = {k: raw[k] / updates for k in keys}
        norms = stats.grad_norms
        out["critic/grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
        out["critic/lr"] = self.engine.lr
        out["critic/updates"] = float(stats.updates)
        out["critic/skipped_updates"] = float(stats.skipped)
        out["critic/skipped_steps_total"] = float(self.engine.skipped_steps)
        out.update(
            perf_metrics(
                raw["perf/tokens"],
                time.perf_counter() - start,
                self.engine.num_params,
                self.info.world_size,
                self.config.peak_flops,
            )
        )
        return out

    def save_checkpoint(
        self,
        root: str | os.PathLike[str],
        *,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path:
        return self.engine.save(root, extra=extra, keep_last=keep_last)

    def load_checkpoint(
        self, root: str | os.PathLike[str], *, step: int | None = None
    ) -> LoadedCheckpoint:
        return self.engine.load(root, step=step)
