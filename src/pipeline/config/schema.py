"""The typed configuration of a run. Each section has its defaults here, in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pipeline.algorithms.config import AlgorithmConfig
from pipeline.errors import ConfigError, UnknownPool
from pipeline.training.config import LoraSection, PolicyTrainerSection, TrainerSection
from pipeline.transport.channel import ChannelConfig
from pipeline.wire.roles import QUEUES, ROLES, TRAINER_ROLES

# CUDA_MPS_CLIENT_PRIORITY of each services.ROLE.gpu_priority
GPU_PRIORITIES = {"normal": 0, "below_normal": 1}
GPU_PRIORITY_CHOICES = ("auto", *GPU_PRIORITIES)


def _require(key: str, value: object, ok: bool, rule: str) -> None:
    """Refuse `key` = `value` unless `ok`, saying the rule it breaks."""
    if not ok:
        raise ConfigError(f"set {key} {rule} (got {value!r})")


def _seconds(key: str, value: float, *, zero: bool = False) -> None:
    """A finite number of seconds, > 0 (>= 0 with `zero`)."""
    ok = math.isfinite(value) and (value >= 0 if zero else value > 0)
    _require(key, value, ok, ">= 0 (finite seconds)" if zero else "> 0 (finite seconds)")


@dataclass(frozen=True)
class RunConfig:
    # the run's directory name under runs_dir (`pipeline run --name`)
    name: str = "local-cpu"
    # where run directories go
    runs_dir: str = "runs"
    # seeds the dataset order, the tiny model, the engines' sampling
    seed: int = 0
    # "ipc" puts sockets in the run directory (one host); "tcp" binds `host` ports
    transport: Literal["ipc", "tcp"] = "ipc"
    # the controller's address on tcp (and the default pool host)
    host: str = "127.0.0.1"
    # the control socket's port on tcp; the queues and the weight hub follow from it (0: 29400
    # in rendered deployments)
    controller_port: int = 0
    # seconds a service waits for the controller's answer to its hello
    handshake_timeout_s: float = 20.0
    # torch threads per service process (several services share a CPU host)
    torch_threads: int = 1
    # where torch.compile keeps what it compiled (inductor's and Triton's caches, under
    # inductor/ and triton/): a later run on this machine reuses it and starts in a fraction
    # of the time; empty: torch's defaults in the system temp directory. The variables
    # TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, when set, win
    compile_cache_dir: str = "~/.cache/asyncrl"
    # CURVE keys made by `pipeline keys DIR`: every non-loopback socket is authenticated
    # and encrypted with them; binding a non-loopback address without keys is refused
    keys_dir: str = ""
    # allow binding a non-loopback address without CURVE keys (never in production)
    allow_insecure: bool = False
    # services sharing one GPU: "mps" runs their kernels side by side under a CUDA MPS
    # daemon of the run's own, "turns" pauses generation while the learner trains a step
    # (the engines keep their running samples and resume under the new weights),
    # "time-slice" leaves it to the driver; "auto": MPS where services share a GPU at
    # staleness >= 1 and the MPS tools are there, time-slicing otherwise; the run log says
    # which and why
    gpu_sharing: Literal["auto", "turns", "mps", "time-slice"] = "auto"

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name {self.name!r} must be a non-empty name without '/'")
        _require("run.torch_threads", self.torch_threads, self.torch_threads >= 1, ">= 1")
        _seconds("run.handshake_timeout_s", self.handshake_timeout_s)


# heartbeats an idle link sends within queues.peer_timeout_s
HEARTBEATS_PER_TIMEOUT = 10


@dataclass(frozen=True)
class QueuesConfig:
    # a peer silent this long is dead: its unacknowledged items go to another consumer (an
    # idle link sends a heartbeat every tenth of it)
    peer_timeout_s: float = 5.0
    # queues appended to runs/<name>/queues/<queue>.log (replay and inspect read them)
    record: list[str] = field(default_factory=lambda: list(QUEUES))

    @property
    def channel(self) -> ChannelConfig:
        """Every queue's and the control link's settings: the liveness ones set here, the
        credit, backpressure and size limits the transport's own (constants)."""
        return ChannelConfig(
            heartbeat_s=self.peer_timeout_s / HEARTBEATS_PER_TIMEOUT,
            peer_timeout_s=self.peer_timeout_s,
        )

    def validate(self) -> None:
        self.channel.validate()
        unknown = sorted(set(self.record) - set(QUEUES))
        if unknown:
            raise ConfigError(
                f"queues.record names unknown queues {unknown}; known: {list(QUEUES)}"
            )


@dataclass(frozen=True)
class PoolConfig:
    # the host every service placed on this pool binds and is reached at
    host: str = "127.0.0.1"
    # cpu or cuda
    kind: Literal["cpu", "cuda"] = "cpu"
    # the GPU indices of a cuda pool (CUDA_VISIBLE_DEVICES of its replicas)
    devices: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PlacementConfig:
    # the pool this role runs on
    pool: str = "local"
    # processes of this role (controller and learner: exactly 1)
    replicas: int = 1
    # GPUs each replica sees, sliced from the pool in order (0: all of the pool's)
    devices_per_replica: int = 0
    # where this role's slices start in the pool's device list: two roles on one node's
    # pool take disjoint GPUs (a learner on the first six, the critic on the last two)
    first_device: int = 0
    # ranks of one FSDP2 data-parallel trainer (learner, critic), started under torchrun
    fsdp_size: int = 1
    # tensor-parallel ranks of one engine replica (rollout only): the built-in engine runs
    # tp processes under torchrun, one device each; vLLM gets tensor_parallel_size
    tp: int = 1
    # under CUDA MPS, this role's scheduling priority among the GPU's clients
    # (CUDA_MPS_CLIENT_PRIORITY): "normal", "below_normal" (the others' kernels take the SMs
    # first), or "auto": normal for the rollout, below normal for every other role
    gpu_priority: str = "auto"
    # the `python -m` module that serves this role: empty for the project's own
    # (services.<role>); yours subclasses that service and ends with `SERVICE = YourClass`
    # and the same main() (pipeline.runtime.cli_args.run_service)
    module: str = ""

    def validate(self) -> None:
        if self.replicas < 0:
            raise ConfigError("services.*.replicas must be >= 0")
        if self.module and not all(part.isidentifier() for part in self.module.split(".")):
            raise ConfigError(
                f"services.*.module = {self.module!r} is not a dotted module name "
                "(e.g. mypackage.my_rollout)"
            )
        if self.tp < 1 or self.fsdp_size < 1:
            raise ConfigError("services.*.tp and fsdp_size must be >= 1")
        _require("services.*.first_device", self.first_device, self.first_device >= 0, ">= 0")
        _require(
            "services.*.gpu_priority",
            self.gpu_priority,
            self.gpu_priority in GPU_PRIORITY_CHOICES,
            f"to one of {list(GPU_PRIORITY_CHOICES)}",
        )

    def check_role(self, role: str) -> None:
        """What this role's service can honour: only trainers shard, only engines split a
        model by tensor parallelism."""
        if self.fsdp_size > 1 and role not in TRAINER_ROLES:
            raise ConfigError(
                f"services.{role}.fsdp_size = {self.fsdp_size}: only {list(TRAINER_ROLES)} "
                f"shard with FSDP; set it to 1 and raise services.{role}.replicas instead"
            )
        if self.tp > 1 and role != "rollout":
            raise ConfigError(
                f"services.{role}.tp = {self.tp}: only the rollout's engines split a model "
                "by tensor parallelism; set it to 1 (trainers shard with fsdp_size)"
            )


@dataclass(frozen=True)
class TaskConfig:
    # "toy_reverse" or "toy_lookup" (generated: the toy tool task, with environment.name =
    # "toy_lookup"), or a path to a parquet/jsonl file in the RL schema
    dataset: str = "toy_reverse"
    # prompts generated for toy_reverse / toy_lookup
    dataset_size: int = 512
    # the longest prompt in tokens; a dataset with longer ones is refused (or, with
    # drop_long_prompts, they are dropped and counted)
    max_prompt_tokens: int = 64
    # drop the prompts longer than max_prompt_tokens (their count is printed at start)
    # instead of refusing the dataset
    drop_long_prompts: bool = False
    # supervised steps on copying digits before RL (the generated tiny model only)
    warm_start_steps: int = 200

    def validate(self) -> None:
        _require("task.dataset_size", self.dataset_size, self.dataset_size >= 1, ">= 1")
        _require(
            "task.max_prompt_tokens", self.max_prompt_tokens, self.max_prompt_tokens >= 1, ">= 1"
        )
        _require("task.warm_start_steps", self.warm_start_steps, self.warm_start_steps >= 0, ">= 0")


@dataclass(frozen=True)
class ControllerConfig:
    # learner steps in the run
    steps: int = 20
    # prompts (groups of n_samples) the learner trains on per step
    prompts_per_step: int = 8
    # versions a trained sample may lag the learner (0: synchronous PPO)
    max_staleness: int = 1
    # prompts released but not yet trained, at most (also bounded by staleness)
    max_inflight_prompts: int = 64
    # seconds without a finished step before the run ends as stalled
    step_timeout_s: float = 120.0
    # the same for the first step a controller sees finish, which waits for every service's
    # compiles and CUDA-graph captures on its first batch; 0: step_timeout_s
    first_step_timeout_s: float = 0.0
    # steps in a row in which every sample's reward failed (the verifier raised or timed
    # out), or the learner skipped every optimizer step (a non-finite loss or gradient: the
    # policy diverged, or a kernel is wrong), before the run ends with an error; 0: never
    failed_steps: int = 5

    def validate(self) -> None:
        if self.steps < 1 or self.prompts_per_step < 1:
            raise ConfigError("controller.steps and controller.prompts_per_step must be >= 1")
        if self.step_timeout_s <= 0 or self.first_step_timeout_s < 0:
            raise ConfigError(
                "controller.step_timeout_s must be > 0 and controller.first_step_timeout_s "
                ">= 0 (0: the first step gets step_timeout_s)"
            )
        if self.max_staleness < 0:
            raise ConfigError("controller.max_staleness must be >= 0 (0 = synchronous PPO)")
        _require(
            "controller.max_inflight_prompts",
            self.max_inflight_prompts,
            self.max_inflight_prompts >= 1,
            ">= 1 (prompts released and not yet trained)",
        )
        _seconds("controller.step_timeout_s", self.step_timeout_s)
        _require("controller.failed_steps", self.failed_steps, self.failed_steps >= 0, ">= 0")
        _seconds("controller.first_step_timeout_s", self.first_step_timeout_s, zero=True)


@dataclass(frozen=True)
class RolloutConfig:
    # torch (built-in), hf (transformers generate) or vllm
    engine: Literal["torch", "hf", "vllm"] = "torch"
    # responses per prompt (a group)
    n_samples: int = 4
    # the longest response in tokens; a dataset row's `max_new_tokens` may ask for fewer
    max_new_tokens: int = 16
    # sampling temperature (0: greedy); the learner computes its log-probs at it
    temperature: float = 1.0
    # nucleus sampling mass (1: off)
    top_p: float = 1.0
    # sample among the k likeliest tokens (-1: off)
    top_k: int = -1
    # sequences one engine decodes at once
    max_batch: int = 64
    # the built-in engine on a GPU: "auto" compiles its blocks and sampler (at start-up),
    # replays decode steps as CUDA graphs, reads each step's finished rows one step late (the
    # host never waits for the device) and attends and samples by the Triton kernels where
    # they run (half precision); "off": the plain eager path. The same tokens either way
    kernels: Literal["auto", "off"] = "auto"
    # the built-in engine after a weight update: "recompute" prefills every running sample
    # again under the new weights (each token a draw from the version it is tagged with),
    # "keep" goes on from the keys and values the old weights computed (no prefill; later
    # tokens come from a mix of versions, corrected by the importance weights)
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    # prompts one replica generates at once; 0: enough to fill max_batch on a GPU, 8 on a
    # CPU (there a bigger batch is no faster, and a step's prompts all generated by one
    # policy version learned slower: docs/performance.md)
    prompts_in_flight: int = 0

    def validate(self) -> None:
        if self.n_samples < 1:
            raise ConfigError("rollout.n_samples must be >= 1")
        if not 0 < self.top_p <= 1:
            raise ConfigError("rollout.top_p must be in (0, 1]")
        _require("rollout.max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1")
        ok = math.isfinite(self.temperature) and self.temperature >= 0
        _require("rollout.temperature", self.temperature, ok, ">= 0 (0: greedy)")
        _require("rollout.top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "-1 or >= 1")
        _require("rollout.max_batch", self.max_batch, self.max_batch >= 1, ">= 1")
        ok = self.prompts_in_flight >= 0
        _require("rollout.prompts_in_flight", self.prompts_in_flight, ok, ">= 0 (0: auto)")


@dataclass(frozen=True)
class RewardConfig:
    # "auto": pick the verifier by each sample's data_source; or a name / "module:function";
    # "environment": multi-turn episodes keep the score their environment gave them
    function: str = "auto"
    # seconds one verifier call may take before it scores 0 and counts as an error
    timeout_s: float = 5.0

    def validate(self) -> None:
        _seconds("reward.timeout_s", self.timeout_s)


@dataclass(frozen=True)
class EnvironmentConfig:
    # multi-turn episodes: "" (one response per sample), a built-in ("toy_lookup",
    # "gsm8k_python") or a user class "package.module:Class" / "path/to/file.py:Class"
    name: str = ""
    # keyword arguments of the environment's class
    options: dict[str, Any] = field(default_factory=dict)
    # policy turns per episode, at most (rollout.max_new_tokens bounds all of an episode's
    # tokens, the environment's included)
    max_turns: int = 4
    # seconds one reset/step/close call may take before the episode fails as timed out
    step_timeout_s: float = 10.0
    # environment worker processes per rollout replica
    workers: int = 2
    # the built-in engine keeps an episode's KV cache while it waits for its environment,
    # and its next turn prefills only the new tokens (rollout.kv_on_update decides after a
    # weight update); false: every turn prefills the whole sequence again
    keep_kv: bool = True

    def validate(self) -> None:
        _require("environment.max_turns", self.max_turns, self.max_turns >= 1, ">= 1")
        _require("environment.workers", self.workers, self.workers >= 1, ">= 1")
        _seconds("environment.step_timeout_s", self.step_timeout_s)


@dataclass(frozen=True)
class WeightSyncSection:
    # size of one broadcast bucket (MiB; fractions for small models). A sharded learner
    # (fsdp_size > 1, over NCCL or gloo) sends striped: each rank its own buckets' share
    bucket_mb: float = 1024.0

    def validate(self) -> None:
        if not self.bucket_mb * (1 << 20) >= 64:
            raise ConfigError("learner.weights.bucket_mb must be at least 64 bytes' worth")


@dataclass(frozen=True)
class LearnerConfig:
    trainer: PolicyTrainerSection = field(default_factory=lambda: PolicyTrainerSection(lr=1e-5))
    # save a checkpoint every this many steps (0: only at the end of the run); the critic
    # saves its value model, optimizer and KL controller every this many value updates
    checkpoint_every: int = 0
    # and every this many seconds since the last save (0: off): what a crash may lose
    checkpoint_every_s: float = 300.0
    # checkpoints kept on disk (the newest; older ones are deleted)
    keep_checkpoints: int = 2
    weights: WeightSyncSection = field(default_factory=WeightSyncSection)
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass(frozen=True)
class CriticConfig:
    # a learned value model (needed by gae and vtrace)
    enabled: bool = True
    trainer: TrainerSection = field(default_factory=lambda: TrainerSection(lr=1e-4))
    # groups that arrived while the critic was busy, annotated in one forward (at most this
    # many, never across a value update): fewer, larger forwards. 1: one group a forward.
    # An adaptive KL controller (algorithm.kl_ctrl_type) then updates once per forward.
    # The batches go to runs/<name>/critic/batches.jsonl, which `pipeline replay` follows
    annotate_max_groups: int = 1

    def validate(self) -> None:
        _require(
            "critic.annotate_max_groups", self.annotate_max_groups, self.annotate_max_groups >= 1,
            ">= 1",
        )  # fmt: skip


# where the frozen reference policy's log-probs are computed, when KL needs them
ReferenceHost = Literal["auto", "learner", "critic", "service"]


@dataclass(frozen=True)
class ReferenceConfig:
    # "service": its own role between reward and critic ([services.reference], its own
    # pool); "critic" / "learner": inside that process (one GPU, CPU runs); "auto": the
    # service when [services.reference] is placed, else the critic when the reward's KL
    # penalty needs it upstream of the learner, else the learner
    host: ReferenceHost = "auto"


@dataclass(frozen=True)
class ModelSection:
    # a local Hugging Face directory; empty: the project makes its tiny model in the run dir
    path: str = ""
    # the engines' weight dtype (the learner keeps float32 masters)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass(frozen=True)
class MetricsConfig:
    # live TensorBoard events of every step in runs/<name>/tensorboard/
    tensorboard: bool = True
    # every step's metrics to Weights & Biases too (needs the wandb package: the `wandb`
    # extra); wandb's WANDB_PROJECT and WANDB_MODE apply, else project "asyncrl" and mode
    # "offline" (the run under runs/<name>/wandb/ for `wandb sync` later)
    wandb: bool = False

    def validate(self) -> None:
        if self.wandb:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(
                    "metrics.wandb = true needs the wandb package: pip install "
                    "'asyncrl-pipeline[wandb]' (or set metrics.wandb = false)"
                )


@dataclass(frozen=True)
class SupervisorConfig:
    # restarts of one service within an hour before the run ends (older ones no longer
    # count: RESTART_WINDOW_S)
    max_restarts: int = 3
    # seconds a service gets to stop after SIGTERM before SIGKILL
    stop_timeout_s: float = 10.0
    # seconds the services get, once the run has finished, to save their last state and
    # exit on their own (a trainer's last checkpoint) before they are stopped
    save_timeout_s: float = 600.0

    def validate(self) -> None:
        _require("supervisor.max_restarts", self.max_restarts, self.max_restarts >= 0, ">= 0")
        _seconds("supervisor.stop_timeout_s", self.stop_timeout_s)
        _seconds("supervisor.save_timeout_s", self.save_timeout_s, zero=True)


@dataclass(frozen=True)
class PipelineConfig:
    run: RunConfig = field(default_factory=RunConfig)
    queues: QueuesConfig = field(default_factory=QueuesConfig)
    pools: dict[str, PoolConfig] = field(default_factory=lambda: {"local": PoolConfig()})
    services: dict[str, PlacementConfig] = field(
        default_factory=lambda: {
            "controller": PlacementConfig(),
            "rollout": PlacementConfig(),
            "reward": PlacementConfig(),
            "critic": PlacementConfig(),
            "learner": PlacementConfig(),
        }
    )
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelSection = field(default_factory=ModelSection)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def validate(self) -> None:
        self._validate_security()
        unknown = sorted(set(self.services) - set(ROLES))
        if unknown:
            raise ConfigError(f"services names unknown roles {unknown}; known roles: {list(ROLES)}")
        for role in ("controller", "learner"):
            placement = self.services.get(role)
            if placement is None or placement.replicas != 1:
                raise ConfigError(f"services.{role}.replicas must be 1 (it owns the run's state)")
        for role, placement in self.services.items():
            if placement.pool not in self.pools:
                raise ConfigError(
                    f"services.{role}.pool = {placement.pool!r} is not a pool; "
                    f"define [pools.{placement.pool}] or use one of {sorted(self.pools)}"
                )
            pool = self.pools[placement.pool]
            need = placement.devices_per_replica * placement.replicas + placement.first_device
            if pool.kind == "cuda" and pool.devices and need > len(pool.devices):
                raise ConfigError(
                    f"services.{role} needs {need} devices but pool {placement.pool!r} has "
                    f"{len(pool.devices)}; lower replicas, devices_per_replica or first_device"
                )
        if self.critic.enabled and self.replicas("critic") < 1:
            raise ConfigError("critic.enabled = true needs a [services.critic] placement")
        if not self.critic.enabled and self.replicas("critic") > 0:
            raise ConfigError(
                "[services.critic] is placed but critic.enabled = false; remove the placement "
                "or enable the critic"
            )
        if self.algorithm.advantage_estimator in ("gae", "vtrace") and not self.critic.enabled:
            raise ConfigError(
                f"algorithm.advantage_estimator = {self.algorithm.advantage_estimator!r} needs "
                "a critic; set critic.enabled = true or use 'grpo' / 'rloo'"
            )
        if self.algorithm.advantage_estimator in ("grpo", "rloo") and self.rollout.n_samples < 2:
            raise ConfigError("group baselines need rollout.n_samples >= 2")
        for role, placement in self.services.items():
            placement.check_role(role)
        if self.reward.function == "environment" and not self.environment.name:
            raise ConfigError(
                "reward.function = 'environment' keeps the score of a multi-turn episode: set "
                "environment.name, or choose a verifier for single-turn samples"
            )
        self._validate_tp()
        self._validate_reference()
        self._validate_trainers()

    def _validate_tp(self) -> None:
        placement = self.services.get("rollout")
        if placement is None or placement.tp == 1:
            return
        tp, engine = placement.tp, self.rollout.engine
        if engine == "hf":
            raise ConfigError(
                f"services.rollout.tp = {tp}: the hf engine runs on one device; use "
                "rollout.engine = 'torch' or 'vllm', or tp = 1"
            )
        if self.pools[placement.pool].kind == "cuda" and placement.devices_per_replica != tp:
            raise ConfigError(
                f"services.rollout.tp = {tp} needs one GPU per TP rank: set "
                f"services.rollout.devices_per_replica = {tp} (it is "
                f"{placement.devices_per_replica})"
            )

    def ranks_per_replica(self, role: str) -> int:
        """Processes of one replica of `role`, started together under torchrun: a sharded
        trainer's fsdp_size, a tensor-parallel built-in engine's tp; else 1 (vLLM starts
        its own TP workers)."""
        placement = self.services.get(role)
        if placement is None:
            return 1
        if role in TRAINER_ROLES:
            return placement.fsdp_size
        if role == "rollout" and self.rollout.engine == "torch":
            return placement.tp
        return 1

    def reference_host(self) -> str | None:
        """Where the reference log-probs are computed ("learner", "critic" or "service"),
        or None when no KL term needs them."""
        alg = self.algorithm
        if not (alg.use_kl_loss or alg.kl_penalty_in_reward):
            return None
        host = self.reference.host
        if host != "auto":
            return host
        if self.replicas("reference") > 0:
            return "service"
        if alg.kl_penalty_in_reward and self.critic.enabled:
            return "critic"
        return "learner"

    def _validate_reference(self) -> None:
        host = self.reference_host()
        placed = self.replicas("reference") > 0
        if host is None:
            if placed:
                raise ConfigError(
                    "[services.reference] is placed but no KL term needs it; set "
                    "algorithm.use_kl_loss or algorithm.kl_penalty_in_reward, or remove it"
                )
            return
        if host == "service" and not placed:
            raise ConfigError(
                "reference.host = 'service' needs a [services.reference] placement (pool, "
                "replicas); or set reference.host = 'auto'"
            )
        if host != "service" and placed:
            raise ConfigError(
                f"[services.reference] is placed but reference.host = {host!r}; remove the "
                "placement or set reference.host = 'service'"
            )
        if host == "critic" and not self.critic.enabled:
            raise ConfigError(
                "reference.host = 'critic' needs critic.enabled = true; use 'learner' or 'service'"
            )
        if host == "learner" and self.algorithm.kl_penalty_in_reward and self.critic.enabled:
            raise ConfigError(
                "algorithm.kl_penalty_in_reward shapes the critic's rewards, before the "
                "learner: set reference.host to 'critic', 'service' or 'auto'"
            )

    def _validate_trainers(self) -> None:
        self.learner.weights.validate()
        self.learner.lora.validate()
        _seconds("learner.checkpoint_every_s", self.learner.checkpoint_every_s, zero=True)
        for key in ("learner.checkpoint_every", "learner.keep_checkpoints"):
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            low = 1 if name == "keep_checkpoints" else 0
            if value < low:
                raise ConfigError(f"{key} must be >= {low} (got {value})")

    def _validate_security(self) -> None:
        if self.run.transport != "tcp" or self.run.keys_dir or self.run.allow_insecure:
            return
        from pipeline.transport.channel import is_loopback

        hosts = {self.run.host} | {
            self.pools[p.pool].host for p in self.services.values() if p.pool in self.pools
        }
        open_hosts = sorted(h for h in hosts if not is_loopback(f"tcp://{h}:1"))
        if open_hosts:
            raise ConfigError(
                f"transport tcp on non-loopback hosts {open_hosts} needs CURVE keys: run "
                "`pipeline keys DIR` and set run.keys_dir = DIR (or run.allow_insecure = true "
                "on a trusted network)"
            )

    def placed_on(self, role: str, pool: str) -> PipelineConfig:
        """This config with `role` placed on `pool`: its host and devices come from that
        pool (`pipeline service ROLE --pool POOL`, a replica started by hand on a host)."""
        if pool not in self.pools:
            raise UnknownPool(
                f"--pool {pool!r} is not a pool of this run; known pools: {sorted(self.pools)} "
                f"(or define [pools.{pool}] in the profile)"
            )
        if role not in self.services:
            raise ConfigError(
                f"{role} is not placed in this run; add [services.{role}] to the profile"
            )
        placement = replace(self.services[role], pool=pool)
        devices = self.pools[pool].devices
        if (
            self.pools[pool].kind == "cuda"
            and devices
            and placement.devices_per_replica > len(devices)
        ):
            raise ConfigError(
                f"services.{role}.devices_per_replica = {placement.devices_per_replica} but "
                f"pool {pool!r} has {len(devices)} devices; pick a larger pool"
            )
        config = replace(self, services={**self.services, role: placement})
        # one replica moves, not the role: the role's device total is not checked here
        config._validate_security()
        return config

    def service_module(self, role: str) -> str:
        """The module `python -m` runs for one replica of `role`."""
        placement = self.services.get(role)
        return (placement.module if placement else "") or f"services.{role}"

    def replicas(self, role: str) -> int:
        placement = self.services.get(role)
        return placement.replicas if placement else 0

    def devices(self, role: str, replica: int = 0) -> list[int]:
        """The pool devices of one replica: replica i takes the i-th slice of
        devices_per_replica (all the pool's devices when that is 0); [] off a CUDA pool or
        when the pool lists none. Services on one pool share its devices."""
        placement = self.services.get(role)
        if placement is None:
            return []
        pool = self.pools[placement.pool]
        if pool.kind != "cuda" or not pool.devices:
            return []
        per = placement.devices_per_replica
        if per <= 0:
            return list(pool.devices)
        start = (placement.first_device + replica * per) % len(pool.devices)
        return [pool.devices[(start + k) % len(pool.devices)] for k in range(per)]

    def shares_device(self, a: str, b: str) -> bool:
        """Whether any replica of role a and the first of role b use one GPU (CUDA IPC then)."""
        mine = {
            (self.services[a].pool, d) for r in range(self.replicas(a)) for d in self.devices(a, r)
        }
        theirs = {(self.services[b].pool, d) for d in self.devices(b, 0)}
        hosts = {self.pools[pool].host for pool, _ in mine | theirs}
        if len(hosts) > 1:
            return False
        return bool({d for _, d in mine} & {d for _, d in theirs})
