"""The learner: decoupled, KL-regularised PPO updates of a causal LM (FSDP2 when distributed).

One `train_step(batch)`:
  1. proximal log-probs are recomputed with the current weights (no grad): the PPO ratio is
     taken against them, while truncated importance weights behaviour -> proximal correct
     for the sampler's staleness and numerics (decoupled PPO, Hilton et al. 2022);
  2. advantages: for grpo/rloo from the scores; for gae from the critic; for vtrace from
     the critic's values and token rewards with the proximal log-probs as the target
     policy (only the learner has them); gae/vtrace whitened over the step's tokens;
  3. PPO epochs x mini-batches x token-budget micro-batches: clipped surrogate, optional KL
     loss to the frozen reference, optional entropy bonus, each micro-batch weighted so
     the accumulated gradient is that of the whole global mini-batch;
  4. clip, step (skipped when the loss or gradient norm is non-finite), LR schedule.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.algorithms import (
    AlgorithmConfig,
    masked_sum,
    truncated_is_weights,
)
from pipeline.errors import ConfigError
from pipeline.models import CausalLM
from pipeline.models.hf_causal import HFModule, load_for_training
from pipeline.training.advantages import global_whiten, group_advantages, vtrace
from pipeline.training.batch import ExperienceBatch
from pipeline.training.checkpoint import LoadedCheckpoint
from pipeline.training.config import TrainerConfig
from pipeline.training.distributed import DistInfo, current_dist_info
from pipeline.training.engine import StagedStep, TrainEngine, perf_metrics
from pipeline.training.errors import BatchError
from pipeline.training.forward import micro_logprobs, response_logprobs
from pipeline.training.lagged_check import LaggedCheck
from pipeline.training.lora import MergedWeights, adapters_off
from pipeline.training.loss_terms import (
    KL_KEYS,
    loss_function,
    micro_keys,
    token_keys,
    token_sums,
)
from pipeline.training.metrics import Metrics, MetricSums, MetricVector
from pipeline.training.micro_batching import MicroBatch
from pipeline.training.phase_clock import PhaseClock
from pipeline.training.proximal_reuse import ReuseCheck
from pipeline.training.reference import ReferencePolicy
from pipeline.training.transformers_path import for_transformers

_BATCH_KEYS = (
    "batch/samples",
    "batch/response_tokens",
    "batch/score_sum",
    "batch/adv_sum",
    "batch/adv_sq_sum",
    "perf/tokens",
)
# V-trace: tokens whose ratio pi/mu exceeds rho_bar by more than this (in log space), so that
# numerics alone (engine and learner kernels, ~1e-6) do not count as truncation
_VTRACE_TRUNCATION_TOL = 1e-3
_VTRACE_KEYS = ("vtrace/truncated_tokens", "vtrace/adv_change_sum")


def _load_causal_lm(model: str | os.PathLike[str] | CausalLM, config: TrainerConfig) -> CausalLM:
    """The native CausalLM or transformers' (HFCausalLM: same entry points, same names)."""
    if isinstance(model, torch.nn.Module):
        return model
    loaded = load_for_training(model, implementation=config.implementation, role="learner")
    return loaded  # type: ignore[return-value]


class PendingStep:
    """A submitted train step: `result()` returns its metrics, reading them from the host
    copy the step queued at its end (waiting for the device up to it, once)."""

    def __init__(self, finish: Callable[[], dict[str, float]], ready: Callable[[], bool]) -> None:
        self._finish: Callable[[], dict[str, float]] | None = finish
        self._ready = ready
        self._metrics: dict[str, float] = {}

    def done(self) -> bool:
        """The device finished the step (`result()` will not wait)."""
        return self._finish is None or self._ready()

    def result(self) -> dict[str, float]:
        if self._finish is not None:
            self._metrics, self._finish = self._finish(), None
        return self._metrics


class PolicyTrainer:
    """Policy model + frozen reference + optimizer; see the module docstring for a step."""

    def __init__(
        self,
        model: str | os.PathLike[str] | CausalLM,
        config: TrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        dist: DistInfo | None = None,
    ) -> None:
        """`model`: a local HF directory (loaded in float32 as master weights) or a CausalLM
        (sharded in place when distributed). Every rank of the default group must build one."""
        self.config = config or TrainerConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        self.config.validate()
        self.algorithm.validate()
        self.info = dist or current_dist_info(self.config.device)
        policy = _load_causal_lm(model, self.config)
        if isinstance(policy, HFModule):
            self.config = for_transformers(self.config)
        keep_ref = self.config.keep_reference
        if keep_ref is None:
            keep_ref = self.algorithm.use_kl_loss or self.algorithm.kl_penalty_in_reward
        lora = self.config.lora.enabled
        # with LoRA the reference is the policy with its adapters off: no second copy
        reference = copy.deepcopy(policy) if keep_ref and not lora else None
        self.engine = TrainEngine(policy, self.config, self.info, name="policy")
        self._last_done = 0.0  # perf_counter when the last step's metrics were read
        self._reuse = ReuseCheck(self.config)
        self._lagged = LaggedCheck(self.config.mismatch_check_every)
        self._loss_terms = loss_function(self.algorithm, self.config.compile_loss)
        self.reference: ReferencePolicy | BaseOfAdapters | None = None
        if reference is not None:
            self.reference = ReferencePolicy(reference, self.config, dist=self.info)
        elif keep_ref and lora:
            self.reference = BaseOfAdapters(self)

    # -- state --------------------------------------------------------------------------

    @property
    def model(self) -> CausalLM:
        return self.engine.model  # type: ignore[return-value]

    @property
    def step(self) -> int:
        """train_step calls completed (restored by load_checkpoint)."""
        return self.engine.train_steps

    def weights_to_publish(self) -> CausalLM | MergedWeights:
        """What the engines receive: the model's parameters, or with LoRA the base's names
        with the adapters merged in (the same names and shapes as a full fine-tune)."""
        return MergedWeights(self.model) if self.config.lora.enabled else self.model

    @property
    def skipped_steps(self) -> int:
        self.engine.settle_staged()
        return self.engine.skipped_steps

    # -- no-grad forwards -------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: ExperienceBatch) -> Tensor:
        """Learner log-probs of the response tokens with the current weights, (n, R) float32."""
        with self.engine.compute_weights():
            return response_logprobs(
                self.model, batch, self.config, self.info.device, self.engine.begin_forward
            )

    @torch.no_grad()
    def ref_logprobs(self, batch: ExperienceBatch) -> Tensor:
        """Reference-model log-probs of the response tokens, (n, R) float32."""
        if self.reference is None:
            raise ConfigError(
                "this PolicyTrainer keeps no reference model; set trainer.keep_reference=true "
                "(or enable algorithm.use_kl_loss / kl_penalty_in_reward)"
            )
        return self.reference.logprobs(batch)

    # -- training -----------------------------------------------------------------------

    def warm_up(self, batches: list[ExperienceBatch]) -> float:
        """Run a step on each batch with one behaviour log-prob made NaN, so that every
        update is skipped and nothing trains: what remains is what a step compiles and
        captures (trunk, reference, loss; grad and no-grad; each attention path the batches
        take). Counters, RNG and weights are as before. Returns the seconds it took."""
        start = time.perf_counter()
        with self.engine.warming_up():
            for batch in batches:
                if self.reference is not None:  # the step runs its own reference forward
                    batch = batch.replace(ref_logprobs=None)
                self.submit_step(poisoned(batch)).result()
        self._last_done = 0.0
        return time.perf_counter() - start

    def train_step(self, batch: ExperienceBatch) -> dict[str, float]:
        """One PPO update on this rank's share of the batch; returns global metrics."""
        return self.submit_step(batch).result()

    def submit_step(
        self, batch: ExperienceBatch, *, on_policy: bool = False, version: int | None = None
    ) -> PendingStep:
        """`train_step` without waiting for the device at its end: the update is queued and
        its metrics come from `result()`. Submitting the next step first lets the host plan
        and queue it while the device finishes this one (the step's host prologue then
        overlaps the device's work instead of preceding it). The weights
        are read in stream order: a forward, a checkpoint or an export after a submit sees
        the update; whatever reads the schedule or the counters settles the step first.
        `on_policy`: the current weights sampled every token of the batch (staleness 0),
        whose behaviour log-probs may then serve as the proximal ones (ReuseCheck).
        `version`: the current weights' policy version; the tokens it sampled give the
        same-version mismatch (`mismatch/same_version_kl`)."""
        start = time.perf_counter()
        alg = self.algorithm
        vtrace = alg.advantage_estimator == "vtrace"
        if vtrace and (batch.values is None or batch.rewards is None):
            raise BatchError(
                "advantage_estimator='vtrace' needs the critic's values and token rewards on "
                "the batch (CriticTrainer.compute_advantages fills both)"
            )
        if batch.advantages is None and not vtrace:
            if alg.advantage_estimator not in ("grpo", "rloo"):
                raise BatchError(
                    f"advantage_estimator={alg.advantage_estimator!r} takes advantages from "
                    "the critic; the batch has none (run CriticTrainer.compute_advantages)"
                )
            batch = group_advantages(batch, alg)
        mask = batch.response_mask
        cfg = self.config
        # V-trace's target log-probs must exist before the first update
        fused = cfg.fuse_proximal and cfg.ppo_epochs == 1 and cfg.mini_batches == 1 and not vtrace
        clock = PhaseClock(self.info.device)
        ref = batch.ref_logprobs
        if ref is None and self.reference is not None:
            ref = self.ref_logprobs(batch)
            clock.mark("reference")
        if alg.use_kl_loss and ref is None:
            raise ConfigError(
                "algorithm.use_kl_loss needs reference log-probs: put ref_logprobs on the batch "
                "or keep a reference model (trainer.keep_reference)"
            )
        kl_keys = list(KL_KEYS) if ref is not None else []
        sums = MetricSums(
            [*micro_keys(alg), *_BATCH_KEYS, *token_keys(ref is not None), *_VTRACE_KEYS],
            ["mismatch/max_abs_diff"],
            self.info.device,
        )
        prox = is_w = None  # fused: each micro-batch takes them from its own forward
        reused = not fused and not vtrace and self._reuse.reuses(on_policy)
        if reused:
            prox = batch.behaviour_logprobs
        elif not fused:
            prox = self.compute_logprobs(batch)  # (n, R)
            clock.mark("proximal")
            if vtrace:
                batch = self._vtrace_advantages(batch, prox, sums)
        if alg.advantage_estimator in ("gae", "vtrace") and alg.whiten_advantages:
            assert batch.advantages is not None
            batch = batch.replace(advantages=global_whiten(batch.advantages, mask))
        same = None
        if version is not None:
            same = mask & (batch.token_versions == version)
            lagged = self._lagged.sums(
                self.model,
                batch,
                version,
                functools.partial(self.compute_logprobs, batch),
                self.engine.masters_changed,
                on_policy=on_policy,
            )
            if lagged is not None:
                sums.add("mismatch/same_version_kl", lagged[0])
                sums.add("mismatch/same_version_tokens", lagged[1])
                clock.mark("lagged_check")
            self._lagged.keep(self.model, version)
        if not fused:
            assert prox is not None
            is_w = truncated_is_weights(
                prox, batch.behaviour_logprobs, mask, cap=alg.is_cap, level=alg.is_level
            )  # (n, R)
            token, top = token_sums(mask, batch.behaviour_logprobs, prox, ref, is_w, alg, same)
            _add_token_sums(sums, token, top, ref is not None)  # over the whole batch
        inputs = {
            "prox": prox,
            "is_w": is_w,
            "ref": ref,
            "adv": batch.advantages,
            "same": same,
        }
        micro_loss = functools.partial(self._micro_loss, batch=batch, inputs=inputs, sums=sums)
        stats = self.engine.run_epochs(batch, alg.loss_agg_mode, micro_loss, sums)
        self._batch_counts(sums, batch)  # host sums: after the device has its work
        sums.add("perf/tokens", float(stats.local_tokens))
        self.engine.train_steps += 1
        staged = self.engine.stage_step(stats, sums)
        clock.mark("update")
        step = self.engine.train_steps

        def finish() -> dict[str, float]:
            raw = self.engine.finish_step(staged)
            done = time.perf_counter()
            # a step submitted before the previous one's result counts from that result
            elapsed = done - max(start, self._last_done)
            self._last_done = done
            out = self._finish_metrics(raw, staged, kl_keys, elapsed, step)
            self._reuse.settle(out, reused=reused, checked=on_policy and not reused)
            return {**out, **clock.seconds()}

        return PendingStep(finish, staged.ready)

    def _micro_loss(
        self,
        dev: MicroBatch,
        host: MicroBatch,
        batch: ExperienceBatch,
        inputs: dict[str, Tensor | None],
        sums: MetricSums,
    ) -> tuple[Tensor | None, Tensor, Metrics]:
        cfg = self.config
        fused = inputs["prox"] is None
        named = {"mask": batch.response_mask, "adv": inputs["adv"], "ref": inputs["ref"]}
        if fused:
            named["behaviour"] = batch.behaviour_logprobs
            named["same"] = inputs["same"]
        else:
            named["prox"], named["is_w"] = inputs["prox"], inputs["is_w"]
        logp, entropy, anchor = micro_logprobs(
            self.model,
            dev,
            chunk_tokens=cfg.logprob_chunk_tokens,
            temperature=cfg.temperature,
            with_entropy=True,
            keep_logits=cfg.logprob_keep_logits,
        )
        if host.is_empty:
            return None, anchor, {}
        # (m, r) each, copied while the device runs the forward just queued: the loss
        # needs them only after it (see MicroBatch.fields_to)
        f = host.fields_to(self.info.device, named)
        assert entropy is not None
        ref = f.get("ref")
        old = f["behaviour"] if fused else f["prox"]
        loss, micro, token, top = self._loss_terms(
            logp,
            entropy,
            f["mask"],
            f["adv"],
            old,
            None if fused else f["is_w"],
            ref,
            f.get("same"),
        )
        if fused:  # the mismatch and KL sums of this micro-batch's own proximal log-probs
            _add_token_sums(sums, token, top, ref is not None)
        return loss, anchor, MetricVector(micro_keys(self.algorithm), micro)

    def _vtrace_advantages(
        self, batch: ExperienceBatch, target: Tensor, sums: MetricSums
    ) -> ExperienceBatch:
        """V-trace advantages from the critic's values and token rewards, with the proximal
        log-probs (the current policy) as the target and the sampler's as the behaviour."""
        alg = self.algorithm
        assert batch.values is not None and batch.rewards is not None
        mask = batch.response_mask
        adv, _ = vtrace(batch.rewards, batch.values, target, batch, alg)
        log_ratio = target - batch.behaviour_logprobs
        truncated = mask & (log_ratio > math.log(alg.vtrace_rho_bar) + _VTRACE_TRUNCATION_TOL)
        sums.add("vtrace/truncated_tokens", float(truncated.sum()))
        if batch.advantages is not None:  # the critic's on-policy (GAE) advantages
            change = masked_sum((adv - batch.advantages).abs().double(), mask)
            sums.add("vtrace/adv_change_sum", change)
        return batch.replace(advantages=adv.float())

    @staticmethod
    def _batch_counts(sums: MetricSums, batch: ExperienceBatch) -> None:
        mask = batch.response_mask
        sums.add("batch/samples", float(batch.num_samples))
        sums.add("batch/response_tokens", float(mask.sum()))
        sums.add("batch/score_sum", batch.scores.double().sum())
        if batch.advantages is not None:
            adv = torch.where(mask, batch.advantages.double(), 0.0)
            sums.add("batch/adv_sum", adv.sum())
            sums.add("batch/adv_sq_sum", adv.square().sum())

    def _finish_metrics(
        self,
        raw: dict[str, float],
        staged: StagedStep,
        kl_keys: list[str],
        elapsed: float,
        step: int,
    ) -> dict[str, float]:
        stats = staged.stats
        tokens = max(raw.pop("batch/response_tokens"), 1.0)
        samples = max(raw.pop("batch/samples"), 1.0)
        updates = max(stats.updates, 1)
        out: dict[str, float] = {}
        for key in ("mismatch/kl", "mismatch/mean_abs_diff", "mismatch/truncated_frac"):
            out[key] = raw.pop(key) / tokens
        out["mismatch/max_abs_diff"] = raw.pop("mismatch/max_abs_diff")
        same_tokens = raw.pop("mismatch/same_version_tokens")
        same_kl = raw.pop("mismatch/same_version_kl")
        if same_tokens > 0:
            out["mismatch/same_version_kl"] = same_kl / same_tokens
        out["mismatch/same_version_frac"] = same_tokens / tokens
        out["actor/is_weight_mean"] = raw.pop("actor/is_weight_mean") / tokens
        for key in kl_keys:
            out[key] = raw.pop(key) / tokens
        out["batch/score_mean"] = raw.pop("batch/score_sum") / samples
        # the advantages trained on (after whitening), over response tokens
        adv_mean = raw.pop("batch/adv_sum") / tokens
        adv_var = max(raw.pop("batch/adv_sq_sum") / tokens - adv_mean**2, 0.0)
        out["actor/advantages_mean"] = adv_mean
        out["actor/advantages_std"] = math.sqrt(adv_var)
        if self.algorithm.advantage_estimator == "vtrace":
            out["vtrace/truncated_frac"] = raw.pop("vtrace/truncated_tokens") / tokens
            out["vtrace/adv_change"] = raw.pop("vtrace/adv_change_sum") / tokens
        else:
            raw.pop("vtrace/truncated_tokens")
            raw.pop("vtrace/adv_change_sum")
        out["batch/response_length_mean"] = tokens / samples
        out.update(
            perf_metrics(
                raw.pop("perf/tokens"),
                elapsed,
                self.engine.num_params,
                self.info.world_size,
                self.config.peak_flops,
            )
        )
        for key, value in raw.items():  # per-micro-batch means over updates
            out[key] = value / updates
        norms = stats.grad_norms
        out["actor/grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
        out["actor/lr"] = staged.lr
        out["actor/updates"] = float(stats.updates)
        out["actor/skipped_updates"] = float(stats.skipped)
        out["actor/skipped_steps_total"] = float(staged.skipped_total)
        out["actor/step"] = float(step)
        out["actor/optimizer_state_bytes"] = float(self.engine.optimizer_state_bytes)
        return out

    # -- persistence --------------------------------------------------------------------

    def save_checkpoint(
        self,
        root: str | os.PathLike[str],
        *,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path:
        """`<root>/step_<step>/` with weights, Adam state, LR schedule, RNG, counters and
        the caller's JSON `extra` (collective). The reference model is not saved: it is
        rebuilt from the initial weights the trainer is constructed with."""
        return self.engine.save(root, extra=extra, keep_last=keep_last)

    def load_checkpoint(
        self, root: str | os.PathLike[str], *, step: int | None = None
    ) -> LoadedCheckpoint:
        """Resume from `latest` (or `step`); returns the step and the caller's `extra`."""
        return self.engine.load(root, step=step)

    def export_hf(self, path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> None:
        """HF safetensors of the current policy (collective; rank 0 writes)."""
        self.engine.export_hf(path, dtype)


class BaseOfAdapters:
    """The reference of a LoRA policy: the policy's own forward with every adapter off, in
    the policy's precision (its frozen base is the initial model)."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> Tensor:
        """Reference log-probs of the response tokens, (n, R) float32, 0 where masked."""
        with adapters_off(self.trainer.model):
            return self.trainer.compute_logprobs(batch)


def poisoned(batch: ExperienceBatch) -> ExperienceBatch:
    """The batch with every sample's first behaviour log-prob NaN: every micro-batch's
    loss is non-finite, so every update (each mini-batch's) is skipped on every rank."""
    behaviour = batch.behaviour_logprobs.clone()
    behaviour[:, 0] = float("nan")
    return batch.replace(behaviour_logprobs=behaviour)


def _add_token_sums(sums: MetricSums, token: Tensor, top: Tensor, with_ref: bool) -> None:
    """`loss_terms.token_sums`' outputs (a vector of sums, the max |log pi - log mu|) into
    the step's sums."""
    sums.add_all(MetricVector(token_keys(with_ref), token))
    sums.max("mismatch/max_abs_diff", top.reshape(()))
