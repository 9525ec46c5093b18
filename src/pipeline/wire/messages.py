"""Every wire schema of the pipeline, in one torch-free module.

A message on the wire is a ZeroMQ multipart: frame 0 is the `Header` (schema version,
type tag, run id, sender, sequence number), frame 1 the msgpack body of the struct that
`MsgType` names, frames 2.. the raw bytes of tensors the body references by `TensorRef`.
No pickle anywhere: bodies are msgspec structs, tensors are dtype + shape + bytes.
New fields must be optional (have defaults) so older peers keep decoding.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import msgspec

from pipeline.wire.weights import Control

SCHEMA_VERSION = 1


class MsgType(enum.IntEnum):
    # control plane
    HELLO = 1
    CONFIG = 2
    READY = 3
    CREDIT = 4
    ACK = 5
    HEARTBEAT = 6
    STEP_DONE = 7
    ERROR = 8
    SHUTDOWN = 9
    METRICS = 10
    DROPPED = 11
    # data plane
    PROMPT = 20
    ROLLOUT = 21
    SCORED = 22
    EXPERIENCE = 23
    # weights
    WEIGHT_META = 30
    WEIGHT_DONE = 31
    WEIGHT_CONTROL = 32


class _Wire(msgspec.Struct, array_like=True, kw_only=True, gc=False, omit_defaults=True):
    """Base of every wire struct: compact positional encoding, no GC tracking."""

    TYPE: ClassVar[MsgType]


class Header(msgspec.Struct, array_like=True, gc=False):
    version: int
    type: int
    run_id: str
    sender: str
    seq: int
    # seconds since the epoch when the sender encoded it (latency accounting, replay order)
    sent_at: float = 0.0


class TensorRef(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A tensor carried out of band: numpy-style dtype name, shape, index of its frame."""

    dtype: str
    shape: tuple[int, ...]
    frame: int


# ----------------------------------------------------------------------------- control


class Hello(_Wire):
    TYPE: ClassVar[MsgType] = MsgType.HELLO
    service: str
    replica: int
    pid: int
    host: str = ""
    # queue name -> endpoint this replica binds as a producer
    endpoints: dict[str, str] = {}
    # "weights" group rank this replica asks for (engines), -1 if none
    devices: list[int] = []
    # a weight receiver of a tensor-parallel engine rank: its rank and the replica's size
    tp_rank: int = 0
    tp_size: int = 1


class ConfigMsg(_Wire):
    """The controller's answer to Hello: the resolved config (JSON text) and the run id."""

    TYPE: ClassVar[MsgType] = MsgType.CONFIG
    run_id: str
    run_dir: str
    config_json: str
    # queue name -> endpoints of every producer replica known now
    peers: dict[str, list[str]] = {}
    policy_version: int = 0


class Ready(_Wire):
    TYPE: ClassVar[MsgType] = MsgType.READY
    service: str
    replica: int


class Credit(_Wire):
    """Consumer -> producer: you may send me `credits` more items."""

    TYPE: ClassVar[MsgType] = MsgType.CREDIT
    queue: str
    credits: int
    consumer: str = ""


class Ack(_Wire):
    """Consumer -> producer: these uids are done; forget them (no redelivery).

    `credits` grants more items in the same message (one message per loop tick carries
    both, so a busy consumer sends one control message per batch, not two per item)."""

    TYPE: ClassVar[MsgType] = MsgType.ACK
    queue: str
    uids: list[str]
    credits: int = 0


class Heartbeat(_Wire):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    service: str
    replica: int = 0
    policy_version: int = -1
    # producer side: items waiting; consumer side: items buffered
    backlog: int = 0


class StepDone(_Wire):
    """Learner -> controller: a training step finished, with its samples and metrics."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_DONE
    step: int
    policy_version: int
    trained_uids: list[str]
    dropped_uids: list[str] = []
    metrics: dict[str, float] = {}


class Dropped(_Wire):
    """Learner -> controller: samples dropped as too stale (the controller replaces them)."""

    TYPE: ClassVar[MsgType] = MsgType.DROPPED
    uids: list[str]
    policy_version: int
    reason: str = "stale"


class Metrics(_Wire):
    TYPE: ClassVar[MsgType] = MsgType.METRICS
    service: str
    replica: int
    step: int
    values: dict[str, float]


class ErrorMsg(_Wire):
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    service: str
    kind: str
    message: str
    replica: int = 0


class Shutdown(_Wire):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN
    reason: str = ""


# ----------------------------------------------------------------------------- data


class Prompt(_Wire):
    """One prompt released by the controller; its samples get uids `<uid>/<i>`."""

    TYPE: ClassVar[MsgType] = MsgType.PROMPT
    uid: str
    prompt_ids: TensorRef  # (prompt_len,) int32
    n_samples: int
    data_source: str = ""
    ground_truth: str = ""
    prompt_text: str = ""
    # learner version when released: the staleness clock
    released_version: int = 0
    max_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # the row's ignore_eos: the end-of-sequence token does not end these samples (last: a
    # recording made before it decodes as False)
    ignore_eos: bool = False


class Sample(msgspec.Struct, array_like=True, kw_only=True, gc=False, omit_defaults=True):
    """One generated response. Tensors are refs into the enclosing message's frames."""

    uid: str
    response_ids: TensorRef  # (resp_len,) int32
    behaviour_logprobs: TensorRef  # (resp_len,) float32
    # policy version that generated each token (two values when an update landed mid-sequence)
    token_versions: TensorRef  # (resp_len,) int32
    finish_reason: str = "length"
    response_text: str = ""
    score: float = 0.0
    ref_logprobs: TensorRef | None = None  # (resp_len,) float32
    values: TensorRef | None = None  # (resp_len,) float32
    advantages: TensorRef | None = None  # (resp_len,) float32
    returns: TensorRef | None = None  # (resp_len,) float32
    # per-token rewards the critic shaped (score minus the KL penalty): V-trace's input
    rewards: TensorRef | None = None  # (resp_len,) float32
    # multi-turn episodes: 1 for the policy's tokens, 0 for the environment's (no loss)
    loss_mask: TensorRef | None = None  # (resp_len,) float32


class SampleGroup(_Wire):
    """The samples of one prompt; the unit of delivery after the rollout stage."""

    uid: str  # the prompt uid; samples carry `<uid>/<i>`
    prompt_ids: TensorRef
    samples: list[Sample]
    data_source: str = ""
    ground_truth: str = ""
    released_version: int = 0
    reward_errors: int = 0
    # the response budget the engine was given for this prompt (tokens)
    max_new_tokens: int = 0
    # what a stage measured on this group (e.g. the critic's kl/coef): the learner averages
    # each over its step's groups into the step's metrics
    stats: dict[str, float] = {}


class Rollout(SampleGroup):
    TYPE: ClassVar[MsgType] = MsgType.ROLLOUT


class Scored(SampleGroup):
    TYPE: ClassVar[MsgType] = MsgType.SCORED


class Experience(SampleGroup):
    TYPE: ClassVar[MsgType] = MsgType.EXPERIENCE


# ----------------------------------------------------------------------------- weights


class WeightEntry(msgspec.Struct, array_like=True, gc=False, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int


class WeightMeta(_Wire):
    """Learner -> engines, ahead of the bytes: what the next update contains."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHT_META
    version: int
    entries: list[WeightEntry]
    bucket_sizes: list[int]
    transport: str  # "gloo" | "nccl" | "cuda_ipc"
    # resharded: the entries are TP rank tp_rank's shards of a tp_size split (1: full
    # tensors), and each bucket comes by a send from learner rank 0 to this engine alone
    tp_rank: int = 0
    tp_size: int = 1
    p2p: bool = False


class WeightDone(_Wire):
    """Engine -> learner: the update is applied and served (or failed, with the reason)."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHT_DONE
    version: int
    engine: str
    ok: bool
    seconds: float = 0.0
    error: str = ""


class WeightControl(_Wire):
    """Learner rank 0 <-> an engine rank: one of the weight sync's control structs."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHT_CONTROL
    ctl: Control


# ------------------------------------------------------------------ ranks of one service


class RankOp(enum.IntEnum):
    """What rank 0 of a multi-rank service (a sharded trainer, a TP engine replica) tells
    its other ranks to run next."""

    CONTEXT = 1  # the run this service joined (once, after rank 0's handshake)
    SETUP = 2  # build the sharded model (and resume from checkpoint `step` when >= 0)
    TRAIN = 3  # one train step on `groups`
    CHECKPOINT = 4  # save a checkpoint whose JSON `extra` is `text`
    PUBLISH = 5  # publish the weights as `version` to the engines
    ANNOTATE = 6  # critic: values and advantages of `groups` (and train when a step is full)
    CLOSE = 7  # the last save and export
    STOP = 8  # leave: rank 0 is done
    ENGINE = 9  # rollout: build this rank's shard of the engine and follow its steps


class RankCommand(msgspec.Struct, array_like=True, kw_only=True, gc=False, omit_defaults=True):
    """Rank 0 -> the other ranks of its service, over torch.distributed (not ZeroMQ).

    `groups` are sample groups as wire frames (`codec.encode` of an `Experience`), so the
    other ranks decode exactly what rank 0 trains on."""

    op: int  # RankOp
    step: int = 0
    version: int = 0
    text: str = ""
    groups: list[list[bytes]] = []


MESSAGE_TYPES: dict[MsgType, type[_Wire]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        ConfigMsg,
        Ready,
        Credit,
        Ack,
        Heartbeat,
        StepDone,
        Dropped,
        Metrics,
        ErrorMsg,
        Shutdown,
        Prompt,
        Rollout,
        Scored,
        Experience,
        WeightMeta,
        WeightDone,
        WeightControl,
    )
}

# which message types each named queue carries
QUEUE_TYPES: dict[str, frozenset[MsgType]] = {
    "prompts": frozenset({MsgType.PROMPT}),
    "rollouts": frozenset({MsgType.ROLLOUT}),
    "scored": frozenset({MsgType.SCORED}),
    "experience": frozenset({MsgType.EXPERIENCE}),
    # scored groups with the reference policy's log-probs (the reference service's output)
    "referenced": frozenset({MsgType.SCORED}),
}
