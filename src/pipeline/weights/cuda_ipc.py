"""CUDA IPC transport for a learner and engines that share one GPU (NCCL cannot put two
ranks on one device, and a device-to-device copy beats any network path).

The learner allocates its bucket slots ONCE and shares their IPC handles ONCE per group
generation; engines open them ONCE (cached by handle) and reuse them every sync. The
handle travels as plain fields (bytes and ints, `wire.IpcHandle`), never pickled. Per
bucket only a small message moves: "bucket k is ready in slot s" (learner -> engines) and
"slot s is free" (engine -> learner) once the engine copied it out, so the learner may
refill the slot.
"""

from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from pipeline.errors import WeightSyncError
from pipeline.weights.control import Received
from pipeline.weights.hub import WeightHub
from pipeline.weights.plan import dtype_name, parse_dtype
from pipeline.wire.messages import Hello, WeightDone
from pipeline.wire.weights import BucketFree, BucketReady, IpcHandle


def share(buffer: torch.Tensor) -> IpcHandle:
    """The IPC handle fields of a CUDA tensor (learner side)."""
    if buffer.device.type != "cuda":
        raise ValueError("only CUDA tensors can be shared through CUDA IPC")
    _, args = reduce_tensor(buffer)
    (
        _cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return IpcHandle(
        size=list(size),
        stride=list(stride),
        offset=int(offset),
        dtype=dtype_name(dtype),
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
    )


_opened: dict[tuple[bytes, int], torch.Tensor] = {}


def open_handle(h: IpcHandle) -> torch.Tensor:
    """The learner's buffer mapped into this process; opened once, then cached."""
    key = (h.handle, h.storage_offset_bytes)
    if key not in _opened:
        dtype = parse_dtype(h.dtype)
        if dtype is None:
            raise ValueError(f"unknown dtype {h.dtype!r} in an IPC handle")
        _opened[key] = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(h.size),
            tuple(h.stride),
            h.offset,
            torch.storage.TypedStorage,
            dtype,
            h.device,
            h.handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            False,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
    return _opened[key]


class IpcSlots:
    """Learner-side bucket slots in GPU memory, allocated once and shared by handle."""

    def __init__(self, nbytes: int, device: torch.device, count: int = 2) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self.handles = [share(b) for b in self.buffers]


class _IpcWork:
    """Completes when every engine said the slot is free again."""

    def __init__(self, sender: IpcSender, bucket: int) -> None:
        self.sender = sender
        self.bucket = bucket

    def wait(self) -> None:
        self.sender.wait_free(self.bucket)


class IpcSender:
    """Announces filled slots to engines and tracks their "free" answers (learner rank 0)."""

    def __init__(self, hub: WeightHub, members: list[str], version: int, timeout_s: float) -> None:
        self.hub = hub
        self.members = members
        self.version = version
        self.timeout_s = timeout_s
        self.freed: dict[int, set[str]] = {}

    def send(self, bucket: int, slot: int, buf: torch.Tensor) -> _IpcWork:
        torch.cuda.current_stream(buf.device).synchronize()  # bytes are in place before "ready"
        msg = BucketReady(version=self.version, bucket=bucket, slot=slot, nbytes=buf.numel())
        for name in self.members:
            if not self.hub.send(name, msg):
                raise WeightSyncError("buckets", name, "engine not connected")
        self.freed.setdefault(bucket, set())
        return _IpcWork(self, bucket)

    def _on_reply(self, name: str | None, rcv: Received) -> bool:
        """Record a slot release; False for anything else (kept for the done round)."""
        ctl = rcv.control
        if name is not None and isinstance(ctl, BucketFree) and ctl.version == self.version:
            self.freed.setdefault(ctl.bucket, set()).add(name)
            return True
        body = rcv.message.body
        if name in self.members and isinstance(body, WeightDone) and not body.ok:
            raise WeightSyncError("buckets", name, body.error)
        if name in self.members and isinstance(body, Hello):
            raise WeightSyncError("buckets", name, "engine restarted during the update")
        return False

    def wait_free(self, bucket: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        kept: list[tuple[str | None, Received]] = []
        try:
            while True:
                missing = [m for m in self.members if m not in self.freed.get(bucket, set())]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError(
                        "buckets",
                        ", ".join(missing),
                        f"did not release bucket {bucket} within {self.timeout_s:.1f}s",
                    )
                got = self.hub.next_reply(left)
                if got is not None and not self._on_reply(*got):
                    kept.append(got)
        finally:
            self.hub.unread(kept)
