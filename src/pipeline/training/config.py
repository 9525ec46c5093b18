"""A trainer's keys (TrainerSection; PolicyTrainerSection for the policy) and what a trainer
runs with (TrainerConfig: those keys and the switches derived from `kernels` and the device).

Algorithm knobs (clip ratios, KL, estimators) live in `pipeline.algorithms.AlgorithmConfig`;
this holds only what decides *how* a batch is pushed through the model and the optimiser.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from pipeline.config import PipelineConfig

from pipeline.errors import ConfigError

Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
_DTYPES: dict[str, str] = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}
_SECTION = "trainer"


Kernels = Literal["auto", "off"]
# peak dense bf16 FLOP/s of one device, by a part of its CUDA name (first match; MFU)
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


@dataclass(frozen=True)
class TrainerSection:
    """critic.trainer: what a value model's trainer tunes (its precision and kernels are
    the learner's: `PolicyTrainerSection`)."""

    # optimiser
    lr: float = 1e-5
    # AdamW's decoupled weight decay
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # None: no clipping (the norm is still reported)
    # schedule (in optimizer steps; total_steps is needed by linear/cosine)
    schedule: Schedule = "constant"
    # optimizer steps of linear warm-up from 0
    warmup_steps: int = 0
    # optimizer steps the linear/cosine schedule decays over
    total_steps: int = 0
    # the schedule's floor as a share of lr
    min_lr_ratio: float = 0.0
    # batching: passes over each step's batch
    ppo_epochs: int = 1
    # optimizer steps per epoch (the batch split into this many)
    mini_batches: int = 1
    # tokens of one forward/backward (gradients accumulate over micro-batches)
    max_tokens_per_micro_batch: int = 4096
    infer_max_tokens_per_micro_batch: int = 0  # no-grad forwards; 0: same as training
    shuffle: bool = False  # permute samples each epoch (seeded by seed, step, epoch)
    # recompute each block in backward (memory for time)
    activation_checkpointing: bool = False

    def validate(self) -> None:
        """Raise ConfigError naming the first bad key."""
        if not self.lr > 0:
            raise ConfigError(f"set {_SECTION}.lr to a value > 0 (got {self.lr})")
        if self.weight_decay < 0:
            raise ConfigError(f"set {_SECTION}.weight_decay >= 0 (got {self.weight_decay})")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"set {_SECTION}.grad_clip > 0 or null (got {self.grad_clip})")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"set {_SECTION}.schedule to one of {SCHEDULES} (got {self.schedule!r})"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"set {_SECTION}.warmup_steps >= 0 (got {self.warmup_steps})")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"{_SECTION}.schedule={self.schedule!r} decays over total_steps; set "
                f"{_SECTION}.total_steps > warmup_steps (got {self.total_steps})"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"set {_SECTION}.min_lr_ratio in [0, 1] (got {self.min_lr_ratio})")
        for key in ("ppo_epochs", "mini_batches", "max_tokens_per_micro_batch"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"set {_SECTION}.{key} to an integer >= 1 (got {value!r})")
        if self.infer_max_tokens_per_micro_batch < 0:
            raise ConfigError(f"set {_SECTION}.infer_max_tokens_per_micro_batch >= 0 (0: same)")


# the linear layers of every block (attention's and the MLP's projections)
LORA_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class LoraSection:
    """learner.lora: train low-rank adapters instead of every weight (training/lora.py)."""

    # the adapters' rank r (0: off, every weight trains). The base weights stay frozen, only
    # the adapters train and keep Adam's state; engines get base + B @ A * alpha / rank
    rank: int = 0
    # the update's scale is alpha / rank
    alpha: float = 16.0
    # dropout on an adapter's input while training (0: none; a non-zero one makes the
    # training forward differ from the proximal one that PPO's ratio divides by)
    dropout: float = 0.0
    # the nn.Linear modules adapted, by the last part of their name
    targets: tuple[str, ...] = LORA_TARGETS

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"set learner.lora.rank to an integer >= 0 (got {self.rank!r})")
        if not self.alpha > 0:
            raise ConfigError(f"set learner.lora.alpha > 0 (got {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"set learner.lora.dropout in [0, 1) (got {self.dropout})")
        if self.rank and not self.targets:
            raise ConfigError("learner.lora.targets is empty: name modules, e.g. ['q_proj']")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class PolicyTrainerSection(TrainerSection):
    """learner.trainer: a trainer's keys, the AdamW constants, precision and kernels of both
    trainers (the critic takes the learner's) and the policy's log-prob keys."""

    # AdamW's moment decays
    betas: tuple[float, float] = (0.9, 0.999)
    # AdamW's epsilon
    eps: float = 1e-8
    # the flat optimizer's first moment (exp_avg) in bfloat16: 24 instead of 28 bytes a
    # parameter per update and 2 bytes a parameter less memory (the update itself computes
    # in float32 and stores the new moment rounded to nearest). As Megatron-core's
    # precision-aware optimizer offers; the second moment stays float32 (its 0.999 decay
    # would stall in bfloat16). Needs the flat optimizer (kernels "auto", one CUDA process)
    exp_avg_dtype: Literal["float32", "bfloat16"] = "float32"
    # precision and placement; "auto": float32 on CPU, bfloat16 params on CUDA
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # "auto": what the device supports (on CUDA: packed varlen micro-batches in bucketed
    # shapes, compiled blocks, the Triton kernels of models/, CUDA graphs of the trunk in
    # one process, the fused and flat AdamW; on CPU: padded micro-batches, eager), "off":
    # the plain eager path (padded micro-batches, torch's AdamW). The same results either
    # way, up to floating-point rounding (`kernel_switches`)
    kernels: Kernels = "auto"
    # a batch the current weights sampled (every token of the learner's current version,
    # staleness 0): its behaviour log-probs are the proximal ones, no forward for them
    # (checked every tenth such step against the learner's)
    reuse_behaviour_logprobs: bool = False
    # every this many steps keep the weights for one step and score the tokens they sampled
    # at the next (one more forward, one copy of the weights): the same-version mismatch
    # when staleness >= 1 leaves few tokens of the current version; 0: off
    mismatch_check_every: int = 10

    def validate(self) -> None:
        super().validate()
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"set {_SECTION}.betas to two numbers in [0, 1) (got {self.betas})")
        if self.param_dtype != "auto" and self.param_dtype not in _DTYPES:
            raise ConfigError(f"set {_SECTION}.param_dtype to auto/float32/bfloat16/float16")
        if self.exp_avg_dtype not in ("float32", "bfloat16"):
            raise ConfigError(
                f"set {_SECTION}.exp_avg_dtype to float32 or bfloat16 (got {self.exp_avg_dtype!r})"
            )
        if self.kernels not in ("auto", "off"):
            raise ConfigError(f"set {_SECTION}.kernels to auto or off (got {self.kernels!r})")
        if isinstance(self.mismatch_check_every, bool) or self.mismatch_check_every < 0:
            raise ConfigError(f"set {_SECTION}.mismatch_check_every to an integer >= 0")


@dataclass(frozen=True)
class TrainerConfig(PolicyTrainerSection):
    """What a trainer runs with: a section's keys, the device of its service's pool and the
    switches that `resolve` derives from its `kernels` and that device (a TrainerConfig built
    directly takes them as given: the tests pick each one)."""

    # cpu, or cuda (cuda:LOCAL_RANK) or cuda:N; a run's is its service's pool kind
    device: str = "cpu"
    # AdamW's fused kernel: None = on CUDA for an unsharded model. Fused, the clip and the
    # skip of a non-finite update happen on the device, with no host sync before the step
    fused_optimizer: bool | None = None
    # with the fused optimizer in one process and low-precision compute: masters, gradients
    # and moments in flat buffers updated by one kernel (training/flat_adamw.py)
    flat_optimizer: bool = True
    # with one optimizer step per update (1 epoch, 1 mini-batch) the proximal policy is the
    # training forward itself: take its log-probs (detached) instead of a separate forward
    fuse_proximal: bool = True
    # with reuse: every this many on-policy steps (the first too) run the forward anyway
    # and measure the engine/learner mismatch (their kernels differ)
    reuse_check_every: int = 10
    # with reuse: a measured mismatch KL above this stops the reuse for the run (logged)
    reuse_max_mismatch_kl: float = 1e-3
    # pack sequences end to end (varlen attention) instead of padding them
    padding_free: bool = True
    # > 0: packed micro-batches padded to a multiple of this many tokens (and cu_seqlens /
    # max_seqlen to powers of two) so CUDA graphs and compiled blocks see few shapes (CUDA's
    # varlen attention takes max_seqlen as a number: each new one recompiles); 0: no padding
    pack_bucket_tokens: int = 0
    # tokens per chunk of the output layer's log-prob pass (memory)
    logprob_chunk_tokens: int = 1024
    # keep a training micro-batch's (tokens, vocab) logits for backward instead of
    # recomputing them chunk by chunk: one GEMM less, 2 bytes * tokens * vocab more memory
    logprob_keep_logits: bool = False
    temperature: float = 1.0  # the sampler's, so PPO ratios use its distribution
    # torch.compile the trunk (see compile_scope, compile_mode)
    compile: bool = False
    # torch.compile mode of the trunk in a single process: "default", "reduce-overhead"
    # (CUDA graphs: one recording per distinct micro-batch shape), or "max-autotune" (CUDA
    # graphs, and inductor benchmarks Triton GEMM templates against cuBLAS per shape at
    # compile time: minutes more of compilation)
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    # what one compiled region is in a single process: "trunk" (embeddings, every block and
    # the final norm: one graph, least host work per call) or "blocks" (each decoder block:
    # one block's code is traced and compiled once and serves every layer, so a cold start
    # compiles 1/num_layers of the trunk). A sharded trainer always compiles blocks
    compile_scope: Literal["trunk", "blocks"] = "trunk"
    # symbolic sizes from the first compile (packed token count, number of sequences, the
    # longest sequence): micro-batches of new lengths never recompile mid-run
    compile_dynamic: bool = True
    # torch.compile's backend: "inductor" (Triton/C++ kernels), or "aot_eager" to check
    # what compiles without generating kernels
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # the micro-batch's policy loss and metrics (training/loss_terms.py) as one compiled
    # function, dynamic shapes: a few fused kernels each way instead of ~190 small ones
    compile_loss: bool = False
    # inductor options of that compilation on top of the mode's, e.g.
    # {"triton.mix_order_reduction": False}: names and types as in torch._inductor.config
    # (checked when the trainer builds); the sharded trainer compiles each block with them
    compile_options: dict[str, bool | int | float | str] = dataclasses.field(default_factory=dict)
    # a single CUDA process: the packed training forward and backward of the trunk replayed
    # from CUDA graphs captured per bucketed shape (training/trunk_graphs.py): none of the
    # compiled trunk's per-call host work over its parameter inputs. Needs padding_free,
    # pack_bucket_tokens > 0 and compile_mode "default" (inductor's own graphs cannot nest).
    # Varlen micro-batches only: uniform ones (see uniform_attention) run the compiled trunk
    trunk_graphs: bool = False
    # with trunk_graphs: the no-grad packed forwards too (the reference's, the proximal
    # policy's), one forward-only graph per bucketed shape in a pool of their own
    trunk_graphs_no_grad: bool = True
    # RoPE by one Triton pass over the q/k/v projection output each way (models/
    # rope_kernel.py) instead of the compiled torch formula; CUDA half precision only (the
    # formula runs elsewhere), models without q/k norms
    fused_rope: bool = False
    # every residual add inside the next RMSNorm, both in one Triton pass each way (models/
    # norm_kernel.py): the norm's backward in one kernel and its weight gradient's final sum
    # in a second, instead of inductor's three; the torch formula where Triton cannot run
    fused_norm: bool = False
    # the gated MLP's gate and up projections as one GEMM over their concatenated weights
    # and SwiGLU by one Triton pass each way over its output (models/swiglu_kernel.py): one
    # GEMM fewer each way and no strided split; the torch formula where Triton cannot run
    packed_mlp: bool = False
    # a packed micro-batch whose sequences all have one length (no padding) attends as a
    # (sequences, length) causal batch: cuDNN's fused attention on CUDA (its forward and
    # backward faster than flash varlen's: docs/performance.md), SDPA elsewhere.
    # Mixed lengths always take the varlen kernel (torch 2.11's ragged cuDNN backward gave
    # wrong gradients in a probe)
    uniform_attention: bool = True
    # tied embeddings in one process: the embedding's gradient rows are added into the
    # output layer's gradient in place (models/tied_embedding.py) instead of a dense table
    # gradient that autograd adds to it (docs/performance.md). Not with
    # trunk_graphs (its graphs take token ids) nor under FSDP (dense, as nn.Embedding)
    tied_grad_rows: bool = True
    # reference model: None keeps one only when the algorithm needs it (KL loss / reward)
    keep_reference: bool | None = None
    # reporting: peak FLOP/s of one device (0 disables MFU, e.g. on CPU; `device_peak_flops`)
    peak_flops: float = 0.0
    # dtype of FSDP's gradient reduction
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # seeds the shuffle of mini-batches (run.seed in a run: replay stays exact)
    seed: int = 0
    # low-rank adapters (learner.lora; rank 0: off)
    lora: LoraSection = LoraSection()
    # the model's modeling: "auto" runs the native decoder for the families it implements
    # and transformers' AutoModelForCausalLM for any other (models/hf_causal.py);
    # "transformers" forces transformers' for a native family too (the library's option:
    # bench/hf_path.py measures the two)
    implementation: Literal["auto", "native", "transformers"] = "auto"

    def validate(self) -> None:
        """Raise ConfigError naming the first bad key or switch."""
        super().validate()
        if self.reduce_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"set {_SECTION}.reduce_dtype to float32 or bfloat16")
        if isinstance(self.reuse_check_every, bool) or self.reuse_check_every < 1:
            raise ConfigError(f"set {_SECTION}.reuse_check_every to an integer >= 1")
        if not self.reuse_max_mismatch_kl > 0:
            raise ConfigError(f"set {_SECTION}.reuse_max_mismatch_kl > 0")
        if self.pack_bucket_tokens < 0:
            raise ConfigError(f"set {_SECTION}.pack_bucket_tokens >= 0 (0: no padding)")
        if self.logprob_chunk_tokens < 1:
            raise ConfigError(f"set {_SECTION}.logprob_chunk_tokens >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"set {_SECTION}.temperature > 0 (got {self.temperature})")
        if self.compile_scope not in ("trunk", "blocks"):
            raise ConfigError(f"set {_SECTION}.compile_scope to trunk or blocks")
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            raise ConfigError(f"set {_SECTION}.compile_backend to inductor, aot_eager or eager")
        if self.compile_backend != "inductor" and (
            self.compile_mode != "default" or self.compile_options
        ):
            raise ConfigError(
                f"{_SECTION}.compile_mode and compile_options configure inductor; with "
                f"compile_backend = {self.compile_backend!r} leave them at their defaults"
            )
        if self.compile and self.compile_scope == "blocks" and self.cuda_graphs:
            raise ConfigError(
                f"{_SECTION}.compile_scope = 'blocks' replays one block's graph for every "
                "layer of a step, which inductor's CUDA graph trees cannot (a later layer "
                "overwrites an earlier one's output): set compile_mode = 'default', or "
                "compile_scope = 'trunk'"
            )
        if self.compile_mode not in ("default", "reduce-overhead", "max-autotune"):
            raise ConfigError(
                f"set {_SECTION}.compile_mode to default, reduce-overhead or max-autotune "
                f"(got {self.compile_mode!r})"
            )
        if self.trunk_graphs:
            self._validate_trunk_graphs()
        if self.peak_flops < 0:
            raise ConfigError(f"set {_SECTION}.peak_flops >= 0 (0 disables MFU)")
        self.lora.validate()

    def _validate_trunk_graphs(self) -> None:
        if self.compile and self.compile_mode != "default":
            raise ConfigError(
                f"{_SECTION}.trunk_graphs captures the trunk itself: set {_SECTION}.compile_mode "
                f"to default (got {self.compile_mode!r}, whose CUDA graphs cannot nest in it)"
            )
        if not self.padding_free or self.pack_bucket_tokens < 1:
            raise ConfigError(
                f"{_SECTION}.trunk_graphs replays packed micro-batches of bucketed shapes: set "
                f"{_SECTION}.padding_free = true and {_SECTION}.pack_bucket_tokens >= 1"
            )

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Module.compile` for a compiled region: the backend, dynamic
        sizes, and inductor's mode alone or, with `compile_options`, the mode's inductor
        options and these (torch takes one or the other)."""
        common: dict[str, Any] = {"dynamic": True if self.compile_dynamic else None}
        if self.compile_backend != "inductor":
            return {"backend": self.compile_backend, **common}
        if not self.compile_options:
            return {"mode": self.compile_mode, **common}
        # checked here, where the trainer builds, not in validate(): the launcher imports
        # no torch (seconds on a host whose packages hold no bytecode)
        _check_inductor_options(self.compile_options)
        from torch._inductor import list_mode_options

        options = {**list_mode_options(self.compile_mode), **self.compile_options}
        return {"options": options, **common}

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled trunk replays CUDA graphs (its outputs are overwritten by
        the next replay)."""
        return self.compile and self.compile_mode in ("reduce-overhead", "max-autotune")

    def replace(self, **changes: Any) -> TrainerConfig:
        """A validated copy with some fields changed."""
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    @property
    def infer_tokens(self) -> int:
        """Token budget of no-grad forwards (log-probs, values)."""
        return self.infer_max_tokens_per_micro_batch or self.max_tokens_per_micro_batch

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """Parameter dtype used in forward/backward (master weights stay float32)."""
        import torch

        if self.param_dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.param_dtype])

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _DTYPES[self.reduce_dtype])


def _check_inductor_options(options: Mapping[str, Any]) -> None:
    """Each key an inductor config name, each value of its type (what torch.compile would
    raise only at the first call of the compiled module, after the warm-up's traces)."""
    from torch._inductor import config as inductor

    known = inductor.get_config_copy()
    for key, value in options.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"{_SECTION}.compile_options: {key!r} is not an inductor option "
                "(see torch._inductor.config, e.g. triton.mix_order_reduction)"
            )
        kind = type(known[name])
        if known[name] is not None and not isinstance(value, kind):
            raise ConfigError(
                f"{_SECTION}.compile_options.{key} takes a {kind.__name__} (got {value!r})"
            )


def kernel_switches(
    kernels: Kernels, device_type: str, *, sharded: bool, policy: bool
) -> dict[str, Any]:
    """The `TrainerConfig` switches that `kernels` stands for on a device of this type (the
    others keep their defaults). None changes what a step computes, only how: the results
    agree up to floating-point rounding."""
    if kernels == "off":
        return {"padding_free": False, "fused_optimizer": False, "flat_optimizer": False}
    if device_type != "cuda":
        # on CPU a padded micro-batch beats padding-free packing (its block-diagonal mask
        # is dense), and nothing compiles
        return {"padding_free": False}
    switches: dict[str, Any] = {
        "padding_free": True,
        "pack_bucket_tokens": 1024,
        "compile": True,
        # one block compiled for every layer: the start-up compiles one block, not the
        # whole trunk (inductor's CUDA graph trees cannot replay one block's graph for
        # every layer: default mode, and CUDA graphs of our own)
        "compile_scope": "blocks",
        "trunk_graphs": not sharded,
        "fused_rope": True,
        "packed_mlp": True,
        "fused_norm": True,
    }
    if policy:
        switches |= {
            "compile_loss": True,
            "logprob_keep_logits": True,
            "logprob_chunk_tokens": 4096,
            # the policy's step was measured without it (docs/performance.md)
            "compile_options": {"triton.mix_order_reduction": False},
        }
    return switches


def role_device(config: PipelineConfig, role: str) -> str:
    """cuda or cpu: the kind of the pool `role`'s service runs on (a rank of a cuda one
    computes on cuda:LOCAL_RANK)."""
    return "cuda" if config.pools[config.services[role].pool].kind == "cuda" else "cpu"


def device_peak_flops(kind: str) -> float:
    """Peak dense bf16 FLOP/s of this process's CUDA device by its name (PEAK_FLOPS); 0, no
    MFU, on CPU or an unknown device."""
    if kind != "cuda":
        return 0.0
    import torch

    name = torch.cuda.get_device_name()
    return next((flops for part, flops in PEAK_FLOPS if part in name), 0.0)


# the critic's keys that are the learner's (PolicyTrainerSection)
SHARED_WITH_CRITIC = ("betas", "eps", "exp_avg_dtype", "param_dtype", "kernels")


def resolve(config: PipelineConfig, role: str, device: str = "") -> TrainerConfig:
    """The trainer config of `role` (learner or critic) in a run: its section's keys (the
    critic's precision and kernels the learner's), the device it computes on (`device`, else
    its service's pool kind), the switches derived from `kernels` on it, the device's peak
    FLOP/s and the run's seed. A process of several ranks (torchrun) is sharded."""
    policy = role == "learner"
    section: TrainerSection = config.learner.trainer if policy else config.critic.trainer
    keys = {f.name: getattr(section, f.name) for f in fields(section)}
    keys |= {k: getattr(config.learner.trainer, k) for k in SHARED_WITH_CRITIC}
    keys["device"] = device or role_device(config, role)
    kind = keys["device"].split(":")[0]
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    switches = kernel_switches(keys["kernels"], kind, sharded=sharded, policy=policy)
    trainer = TrainerConfig(
        **keys, **switches, peak_flops=device_peak_flops(kind), seed=config.run.seed
    )
    trainer.validate()
    return trainer


def critic_config(config: PipelineConfig) -> TrainerConfig:
    """The value model's trainer settings."""
    return resolve(config, "critic")


def policy_config(config: PipelineConfig, device: str = "") -> TrainerConfig:
    """The learner's trainer settings, with the sampler's temperature (PPO ratios and the
    mismatch metrics compare log-probs of the distribution the engine actually sampled;
    greedy engines report temperature-1 log-probs) and a reference model only when the
    reference is hosted in the learner."""
    temperature = config.rollout.temperature or 1.0
    return dataclasses.replace(
        resolve(config, "learner", device),
        temperature=temperature,
        keep_reference=config.reference_host() == "learner",
        lora=config.learner.lora,
    )


def reference_config(config: PipelineConfig, device: str) -> TrainerConfig:
    """The reference's forward: the policy's settings (same temperature, packing and
    precision, so its log-probs compare with the learner's) on the host's device; the base
    model, with no adapters."""
    return dataclasses.replace(
        policy_config(config, device), keep_reference=False, lora=LoraSection()
    )
