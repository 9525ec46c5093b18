"""A trainable model with its sharding, optimizer, LR schedule and the update step.

Shared by the policy and the critic trainers: placement (FSDP2 when the default process
group has more than one rank), mixed precision, gradient clipping, skipping non-finite
updates, and checkpoint save/resume of all of it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor
from torch.profiler import record_function

from pipeline.algorithms import LossAggMode
from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.models import CausalLM, DecoderBase, parallelize
from pipeline.models.decoder import DecoderBlock
from pipeline.models.layers import RowGrouped
from pipeline.training.batch import ExperienceBatch
from pipeline.training.checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from pipeline.training.compile_limits import allow_recompiles
from pipeline.training.config import TrainerConfig
from pipeline.training.distributed import (
    DistInfo,
    all_reduce_ints,
    build_mesh,
    is_distributed,
)
from pipeline.training.export import export_hf
from pipeline.training.flat_adamw import FlatAdamW
from pipeline.training.lora import apply_lora, optimizer_state_bytes
from pipeline.training.metrics import Metrics, MetricSums, split_values
from pipeline.training.micro_batching import MicroBatch, plan_step
from pipeline.training.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    guarded_step,
    is_fused,
)
from pipeline.training.precision import ComputeWeights
from pipeline.training.transfer import HostCopy


@dataclass(frozen=True)
class UpdateOutcome:
    """What happened to one optimizer step."""

    grad_norm: float
    skipped: bool  # non-finite loss or gradient: no update
    lr: float


# (device micro-batch, host micro-batch) -> (loss or None for a dummy, anchor, metrics); the
# anchor (0 * outputs) is backpropagated only for dummies, to run FSDP's collectives
MicroLoss = Callable[[MicroBatch, MicroBatch], tuple[Tensor | None, Tensor, Metrics]]


@dataclass
class EpochStats:
    """Counts over all PPO epochs of one train step (identical on every rank)."""

    updates: int = 0
    skipped: int = 0
    grad_norms: list[float] = field(default_factory=list)  # of applied updates
    local_tokens: int = 0  # prompt + response tokens this rank pushed through backward

    def count(self, outcome: UpdateOutcome) -> None:
        self.updates += 1
        self.skipped += int(outcome.skipped)
        if not outcome.skipped:
            self.grad_norms.append(outcome.grad_norm)


class StagedStep:
    """A train step's metric sums and its last update's outcome on their way to the host
    (`TrainEngine.stage_step`): read once, by whoever needs them first."""

    def __init__(self, keys: list[str], values: Tensor, stats: EpochStats, settles: bool) -> None:
        self.keys = keys
        self.stats = stats
        self.settles = settles  # the tail holds a queued update's (norm, skipped, bad loss)
        self._copy = HostCopy(values)
        self._values: list[float] | None = None
        self.lr = float("nan")  # the schedule's lr once this step settled
        self.skipped_total = 0  # the engine's skipped steps once this step settled

    def ready(self) -> bool:
        """Its values are on the host (reading them will not wait)."""
        return self._values is not None or self._copy.ready()

    def values(self) -> list[float]:
        if self._values is None:
            self._values = self._copy.wait().tolist()
        return self._values


def place_model(
    model: DecoderBase, config: TrainerConfig, info: DistInfo, *, trainable: bool
) -> DecoderBase:
    """Move to the device and shard with FSDP2 when distributed.

    Trainable models stay float32 (master weights): FSDP's mixed-precision policy casts them
    when sharded, `ComputeWeights` swaps in compute copies in a single process. A frozen
    model gets no gradients and, in a single process, is simply stored in the compute dtype.
    """
    from pipeline.models.hf_causal import HFModule

    if isinstance(model, HFModule):  # transformers' modeling: training/transformers_path.py
        from pipeline.training.transformers_path import place_hf_model

        return place_hf_model(model, config, info, trainable=trainable)  # type: ignore[return-value]
    if config.compile:
        allow_recompiles()
    single_dtype = torch.float32
    if not trainable and not is_distributed():
        single_dtype = config.compute_dtype(info.device)
    model = model.to(device=info.device, dtype=single_dtype)
    model.model.fused_norm = config.fused_norm
    model.uniform_attention = config.uniform_attention
    model.tied_grad_rows = (
        config.tied_grad_rows
        and trainable
        and not config.trunk_graphs
        and not is_distributed()
        and not config.lora.enabled  # a frozen embedding has no gradient rows
    )
    for block in cast(Iterable[DecoderBlock], model.model.layers):
        block.self_attn.fused_rope = config.fused_rope
        block.fused_norm = config.fused_norm
        block.mlp.packed = config.packed_mlp
    if isinstance(model, CausalLM):
        model.tie_weights()  # a conversion may have replaced the shared parameter
    if not trainable:
        # no gradients: it runs under no_grad only. Its parameters keep requires_grad as
        # the policy's do, so that its compiled blocks are the policy's no-grad forward
        # (a requires_grad that differs is a variant of its own: compiled and loaded twice)
        model.eval()
    if is_distributed():
        parallelize(
            model,
            build_mesh(info),
            param_dtype=config.compute_dtype(info.device),
            reduce_dtype=config.reduce_torch_dtype,
            activation_checkpointing=config.activation_checkpointing and trainable,
            compile_kwargs=config.compile_kwargs() if config.compile else None,
        )
    else:
        for block in cast(Iterable[DecoderBlock], model.model.layers):
            block.activation_checkpointing = config.activation_checkpointing and trainable
        if config.compile:
            regions = model.model.layers if config.compile_scope == "blocks" else [model.model]
            for region in regions:
                region.compile(**config.compile_kwargs())
        if (
            config.trunk_graphs
            and not config.lora.enabled
            and (trainable or config.trunk_graphs_no_grad)
            and (info.device.type == "cuda")
        ):
            from pipeline.training.trunk_graphs import TrunkGraphs

            model.packed_runner = TrunkGraphs(
                model.model, train=trainable, no_grad=config.trunk_graphs_no_grad
            )
    return model


class TrainEngine:
    """Model + AdamW + LambdaLR with a skip-on-non-finite update."""

    def __init__(
        self, model: DecoderBase, config: TrainerConfig, info: DistInfo, *, name: str
    ) -> None:
        self.config = config
        self.info = info
        self.name = name
        self.log = get_logger(f"training.{name}", rank=info.rank)
        self.num_params = sum(p.numel() for p in model.parameters())
        if config.lora.enabled:  # before placement: FSDP shards the adapters with the rest
            adapted = apply_lora(model, config.lora, seed=config.seed)
            self.log.info("lora", rank=config.lora.rank, modules=len(adapted))
        self.model = place_model(model, config, info, trainable=True)
        self.optimizer = build_optimizer(self.model, config)
        # this rank's Adam moments: LoRA's acceptance compares them with a full fine-tune's
        self.optimizer_state_bytes = optimizer_state_bytes(self.optimizer)
        self.log.info(
            "optimizer_state",
            bytes=self.optimizer_state_bytes,
            trainable_params=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
        )
        self.scheduler = build_scheduler(self.optimizer, config)
        # one process with the fused kernel: clip and skip on the device (queue_update)
        self._device_updates = is_fused(self.optimizer) and not is_distributed()
        dtype = config.compute_dtype(info.device)
        self._compute = None
        self._flat: FlatAdamW | None = None
        if dtype != torch.float32 and not is_distributed():
            # the flat layout holds every parameter: LoRA's frozen base has no gradients
            flat = self._device_updates and config.flat_optimizer and not config.lora.enabled
            self._compute = ComputeWeights(self.model, dtype, flat=flat)
            if self._compute.layout is not None:
                moment = getattr(torch, config.exp_avg_dtype)
                self._flat = FlatAdamW(self.optimizer, self._compute, exp_avg_dtype=moment)
                for module in self.model.modules():  # gate|up and q|k|v share one buffer
                    if isinstance(module, RowGrouped):
                        module.check_adjacent()
        if config.exp_avg_dtype != "float32" and self._flat is None:
            raise ConfigError(
                f"trainer.exp_avg_dtype = {config.exp_avg_dtype!r} needs the flat optimizer "
                "(one process, bfloat16/float16 parameters, fused AdamW, flat_optimizer = "
                "true); set trainer.exp_avg_dtype = 'float32' here"
            )
        self._queued: tuple[Tensor, Tensor, Tensor] | None = None  # norm, skipped, bad loss
        self._staged: StagedStep | None = None  # a step ended by stage_step, not yet settled
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.train_steps = 0  # train_step calls completed (the trainer's step counter)
        self._warming = False

    def compute_weights(self, *, defer: bool = False) -> contextlib.AbstractContextManager[None]:
        """Forward/backward precision: low-precision copies of the float32 masters in a single
        process (see precision.py); FSDP's mixed-precision policy when sharded. `defer`: the
        gradients of a single backward may stay pending for the flat optimizer, which the
        next update reads (`queue_update` / `apply_gradients`)."""
        if self._compute is None:
            return contextlib.nullcontext()
        return self._compute(defer=defer and self._flat is not None)

    def begin_forward(self) -> None:
        """Before each micro-batch forward: under CUDA graphs (`TrainerConfig.cuda_graphs`)
        a new step begins, so the previous replay's outputs may be overwritten; gradients
        left pending by a deferred backward (such outputs) go to float32 first."""
        self._materialize()
        if self.config.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def masters_changed(self) -> None:
        """The float32 masters change without their compute copies (torch's optimizer, a
        load, `LaggedCheck`'s in-place swap): the next entry refreshes the copies (the flat
        optimizer writes both)."""
        if self._compute is not None:
            self._compute.invalidate()

    def _materialize(self) -> None:
        """Pending bf16 gradients (a deferred backward) into the float32 accumulators,
        before anything but the flat optimizer reads `.grad` or another forward runs."""
        if self._compute is not None:
            self._compute.materialize()

    @property
    def lr(self) -> float:
        """The schedule's current lr (settles a staged step first: it may move it)."""
        self.settle_staged()
        return self._schedule_lr()

    def _schedule_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def apply_gradients(self, local_nonfinite: bool, *, empty: bool = False) -> UpdateOutcome:
        """Clip, then step the optimizer and schedule, unless the loss on any rank or the
        global gradient norm is non-finite: then the gradients are dropped and the step is
        counted as skipped, so one bad batch cannot poison the weights or Adam's moments."""
        self.settle_staged()  # the schedule's lr is the settled one
        self._materialize()
        norm = clip_grad_norm(self.model.parameters(), self.config.grad_clip)
        any_bad = all_reduce_ints([int(local_nonfinite)], "max")[0] > 0
        grad_norm = float(norm)
        skipped = any_bad or not torch.isfinite(norm).item()
        if not skipped and not empty:
            self.masters_changed()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if empty and not skipped:  # nothing to learn from: no step, no schedule move
            return UpdateOutcome(grad_norm=grad_norm, skipped=False, lr=self._schedule_lr())
        return self._record(grad_norm, skipped=skipped, nonfinite_loss=any_bad)

    def queue_update(self, nonfinite_loss: Tensor) -> None:
        """`apply_gradients` without a host sync (fused optimizer, one process): clip and the
        non-finite skip run on the device; `settle_into` reads the outcome and steps
        the schedule. The host so queues the next micro-batches while the device still runs
        this update. Settle the previous update first: this step reads the schedule's lr."""
        if self._queued is not None:
            raise RuntimeError("settle the queued update before queueing another")
        self.settle_staged()
        if self._flat is not None and self._flat.ready():
            norm, skipped = self._flat.guarded_step(self.config.grad_clip, nonfinite_loss)
        else:
            self._materialize()
            self.masters_changed()
            norm, skipped = guarded_step(
                self.optimizer, self.model.parameters(), self.config.grad_clip, nonfinite_loss
            )
        self.optimizer.zero_grad(set_to_none=True)
        self._queued = (norm, skipped, nonfinite_loss)

    def settle_into(self, stats: EpochStats) -> None:
        """Read the queued update's outcome (one host sync), count it, step the schedule;
        a staged earlier step settles first (it stepped the schedule before this one)."""
        self.settle_staged()
        if self._queued is not None:
            outcome = torch.stack(self._queued_outcome()).tolist()
            self._queued = None
            self._settle(stats, outcome)

    def read_step(self, stats: EpochStats, sums: MetricSums) -> dict[str, float]:
        """End of a train step: the metric sums (reduced across ranks) and the outcome of
        the update `run_epochs` left queued, in one read of the device (two reads left the
        device idle between them while the host settled the first), then settle it."""
        return self.finish_step(self.stage_step(stats, sums))

    def stage_step(self, stats: EpochStats, sums: MetricSums) -> StagedStep:
        """`read_step` without waiting: the values start their copy to the host and the
        queued update stays unsettled until `finish_step`, or until anything that needs
        the schedule or the counters (the next update, `lr`, `save`, `load`) settles it.
        The host may so plan and queue the next step while the device finishes this one."""
        self.settle_staged()
        keys, values = sums.stage_with(self._queued_outcome())
        staged = StagedStep(keys, values, stats, settles=self._queued is not None)
        self._queued = None
        self._staged = staged
        return staged

    def finish_step(self, staged: StagedStep) -> dict[str, float]:
        """A staged step's metric sums, read from the host copy (waiting for the device up
        to it); settles it if nothing did before."""
        if staged is self._staged:
            self.settle_staged()
        return split_values(staged.keys, staged.values())[0]

    def settle_staged(self) -> None:
        """Settle the step `stage_step` left (count its update, step the schedule)."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        if staged.settles:
            self._settle(staged.stats, split_values(staged.keys, staged.values())[1])
        staged.lr, staged.skipped_total = self._schedule_lr(), self.skipped_steps

    def _queued_outcome(self) -> list[Tensor]:
        """(norm, skipped flag, non-finite loss flag) of the queued update as float device
        scalars, or nothing."""
        if self._queued is None:
            return []
        norm, skipped_flag, bad = self._queued
        return [norm.float(), skipped_flag.float(), bad.float()]

    def _settle(self, stats: EpochStats, outcome: list[float]) -> None:
        grad_norm, flag, bad_loss = outcome
        stats.count(self._record(grad_norm, skipped=flag > 0, nonfinite_loss=bad_loss > 0))

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Steps run inside leave no trace: the caller makes every update non-finite (so it
        is skipped on every rank, weights and Adam untouched), and the counters, the RNG
        and the step timer are put back after. What remains is what the steps compiled
        and captured (`PolicyTrainer.warm_up`)."""
        from pipeline.training.checkpoint import rng_state, set_rng_state

        saved = (self.optimizer_steps, self.skipped_steps, self.train_steps)
        rng = rng_state()
        self._warming = True
        try:
            yield
        finally:
            self.settle_staged()
            self._warming = False
            self.optimizer_steps, self.skipped_steps, self.train_steps = saved
            set_rng_state(rng)

    def _record(self, grad_norm: float, *, skipped: bool, nonfinite_loss: bool) -> UpdateOutcome:
        if skipped and self._warming:
            return UpdateOutcome(grad_norm=grad_norm, skipped=True, lr=self._schedule_lr())
        if skipped:
            self.skipped_steps += 1
            self.log.warning(
                "skipping optimizer step: non-finite loss or gradient",
                nonfinite_loss=nonfinite_loss,
                grad_norm=grad_norm,
                skipped_total=self.skipped_steps,
            )
        else:
            self.scheduler.step()
            self.optimizer_steps += 1
        return UpdateOutcome(grad_norm=grad_norm, skipped=skipped, lr=self._schedule_lr())

    def epoch_order(self, n: int, epoch: int) -> list[int]:
        """Sample order of one PPO epoch: identity, or a permutation seeded by (seed, step,
        epoch) so that a resumed run shuffles exactly like an uninterrupted one."""
        if not self.config.shuffle:
            return list(range(n))
        seed = (self.config.seed * 1_000_003 + self.train_steps * 1_009 + epoch) % 2**63
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

    def run_epochs(
        self,
        batch: ExperienceBatch,
        loss_agg_mode: LossAggMode,
        micro_loss: MicroLoss,
        sums: MetricSums,
    ) -> EpochStats:
        """PPO epochs x mini-batches (one optimizer step each) x weighted micro-batches.

        Each micro-batch metric is added times the micro-batch's share of its global
        mini-batch, so after the cross-rank sum it is a mean over mini-batches * updates.
        The last update may stay queued on the device: end the step with `read_step`.
        """
        cfg = self.config
        stats = EpochStats()
        plans = None
        # the device refreshes the compute copies while the host plans
        prepared = self._compute.prepared() if self._compute is not None else None
        with prepared or contextlib.nullcontext():
            for epoch in range(cfg.ppo_epochs):
                if plans is None or cfg.shuffle:
                    plans = plan_step(
                        batch,
                        num_mini_batches=cfg.mini_batches,
                        max_tokens=cfg.max_tokens_per_micro_batch,
                        loss_agg_mode=loss_agg_mode,
                        order=self.epoch_order(batch.num_samples, epoch),
                        padding_free=cfg.padding_free,
                        bucket=cfg.pack_bucket_tokens,
                        world_size=self.info.world_size,
                        reduce=all_reduce_ints,
                    )
                for plan in plans:
                    bad = torch.zeros((), dtype=torch.bool, device=self.info.device)
                    with self.compute_weights(defer=True):
                        for mb, weight, share in zip(
                            plan.micro_batches, plan.weights, plan.shares, strict=True
                        ):
                            self.begin_forward()
                            with record_function("train/forward"):
                                loss, anchor, metrics = micro_loss(mb.to(self.info.device), mb)
                            with record_function("train/backward"):
                                if loss is None:
                                    anchor.backward()
                                    del anchor
                                    continue
                                (loss * weight).backward()
                                if self._compute is not None:  # into the float32 accumulators
                                    self._compute.flush()
                            bad |= ~torch.isfinite(loss.detach())
                            # the graph dies before the next forward: alive, it keeps the
                            # parameters' AccumulateGrad nodes of the default stream alive,
                            # which a CUDA graph capture's backward then has to sync with
                            # (cudaErrorStreamCaptureImplicit, TrunkGraphs)
                            del loss, anchor
                            stats.local_tokens += mb.num_tokens
                            sums.add_all(metrics, scale=share)
                    with record_function("train/optimizer"):
                        self.settle_into(stats)  # the previous update: one host sync
                        if self._device_updates and plan.global_units > 0:
                            self.queue_update(bad)
                        else:
                            empty = plan.global_units == 0
                            stats.count(self.apply_gradients(bool(bad), empty=empty))
        return stats

    # -- checkpoints ------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "train_steps": self.train_steps,
        }

    def save(
        self,
        root: str | os.PathLike[str],
        *,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path:
        """Checkpoint at the current train step (collective: every rank calls it)."""
        self.settle_staged()
        return save_checkpoint(
            root,
            self.train_steps,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state=self.trainer_state(),
            extra=extra,
            keep_last=keep_last,
        )

    def load(self, root: str | os.PathLike[str], *, step: int | None = None) -> LoadedCheckpoint:
        """Resume model, optimizer, schedule, RNG and counters (collective)."""
        self.settle_staged()
        self.masters_changed()
        loaded = load_checkpoint(
            root,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            step=step,
        )
        state = loaded.trainer_state
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.train_steps = int(state.get("train_steps", loaded.step))
        return loaded

    def export_hf(self, path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> None:
        """HF safetensors of the current weights (collective; rank 0 writes); with LoRA the
        merged model, and the adapters beside it (`lora.adapter_dir`)."""
        lora = self.config.lora if self.config.lora.enabled else None
        export_hf(self.model, path, dtype=dtype, lora=lora)


def perf_metrics(
    tokens: float, elapsed_s: float, num_params: int, world_size: int, peak_flops: float
) -> dict[str, float]:
    """Throughput of a step; MFU = 6 * params * tokens / time / (world * peak) when the
    peak is known (forward + backward of the trained tokens; recompute forwards excluded)."""
    elapsed_s = max(elapsed_s, 1e-9)
    out = {
        "perf/tokens": tokens,
        "perf/step_time_s": elapsed_s,
        "perf/tokens_per_s": tokens / elapsed_s,
    }
    if peak_flops > 0:
        out["perf/mfu"] = 6.0 * num_params * tokens / elapsed_s / (world_size * peak_flops)
    return out
