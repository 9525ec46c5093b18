"""The weight-sync control messages between learner rank 0 and the engines (group
assignment, metadata answers, go/abort, CUDA IPC buffers and buckets, pause), carried in a
`WeightControl` message (`messages.py`) like every other message: msgpack, no pickle."""

from __future__ import annotations

import msgspec


class _Ctl(msgspec.Struct, kw_only=True, tag_field="kind"):
    pass


class GroupAssign(_Ctl, tag="group"):
    """Join weight group `generation` as `rank` (rank 0.. senders-1 are learner ranks)."""

    generation: int
    rank: int
    world: int
    senders: int
    members: list[str]  # member name per rank, for error messages
    backend: str  # gloo | nccl | cuda_ipc
    store_host: str
    store_port: int
    timeout_s: float  # per collective (the bucket phase deadline)
    rendezvous_s: float  # waiting for every member to arrive


class Removed(_Ctl, tag="removed"):
    """The learner removed this engine; `rejoin` says whether to register again."""

    reason: str
    rejoin: bool = True


class MetaAccepted(_Ctl, tag="accepted"):
    """The engine validated the metadata of `attempt` (the WeightMeta header's seq)."""

    version: int
    attempt: int


class MetaRejected(_Ctl, tag="rejected"):
    """The engine refused the metadata; `problems` lists the offending names per kind."""

    version: int
    attempt: int
    error: str
    problems: dict[str, list[str]] = {}


class SyncGo(_Ctl, tag="go"):
    """After every engine answered the metadata: move the bytes, or abort this version."""

    version: int
    attempt: int
    proceed: bool
    reason: str = ""


class IpcHandle(msgspec.Struct, array_like=True):
    """The fields of `torch.multiprocessing.reductions.reduce_tensor` for a CUDA buffer."""

    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcBuffers(_Ctl, tag="ipc_buffers"):
    generation: int
    slots: list[IpcHandle]


class BucketReady(_Ctl, tag="bucket_ready"):
    version: int
    bucket: int
    slot: int
    nbytes: int


class BucketFree(_Ctl, tag="bucket_free"):
    version: int
    bucket: int
    slot: int


class Pause(_Ctl, tag="pause"):
    """The learner starts the step that ends with `version`: an engine taking turns with it
    on one device stops decoding until that version's weights are applied."""

    version: int


Control = (
    GroupAssign
    | Removed
    | MetaAccepted
    | MetaRejected
    | SyncGo
    | IpcBuffers
    | BucketReady
    | BucketFree
    | Pause
)


class SyncFailure(msgspec.Struct):
    """Why a weight sync failed (phase, peer, detail): learner rank 0 tells its other ranks,
    as the text of their PUBLISH command, so that every rank raises the same error."""

    phase: str
    peer: str
    detail: str
