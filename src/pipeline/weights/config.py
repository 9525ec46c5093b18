"""Settings of weight sync: bucket layout, rollout dtype, transport, per-phase timeouts.

Every phase has its own deadline because each one fails differently: a rendezvous waits for
engines to show up, metadata waits for validation, a bucket waits on a collective, and the
final ack waits for an engine's safe point. One global timeout would either be too short
for applying a 7B update or far too long to notice a dead engine during a short bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from pipeline.errors import ConfigError

Transport = Literal["auto", "gloo", "nccl", "cuda_ipc"]
GIB = 1 << 30


@dataclass(frozen=True)
class SyncTimeouts:
    """Seconds each phase may take before it fails with the phase's name."""

    group_s: float = 60.0  # engines arrive at a new weight group's rendezvous
    meta_s: float = 30.0  # engines validate WeightMeta and answer; engines wait for "go"
    bucket_s: float = 120.0  # one bucket's collective (also the weight group's op timeout)
    apply_s: float = 300.0  # an engine applies the update at its safe point and acks

    def validate(self) -> None:
        for name in ("group_s", "meta_s", "bucket_s", "apply_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"weight sync timeout {name} must be > 0")


@dataclass(frozen=True)
class GroupOptions:
    """Where the weight group's sockets listen.

    `hostname` chooses the NIC for gloo. Empty means the library default
    (GLOO_SOCKET_IFNAME or the host's name); NCCL picks its own (NCCL_SOCKET_IFNAME).
    """

    hostname: str = ""


@dataclass(frozen=True)
class PublishConfig:
    """How the learner lays out and sends an update."""

    bucket_bytes: int = GIB
    dtype: torch.dtype = torch.bfloat16  # the rollout dtype; cast before any gather
    striped: bool = False  # every learner rank broadcasts the buckets it owns
    verify: bool = False  # per-entry checksums in WeightMeta (costs one more gather pass)
    transport: Transport = "auto"  # auto: nccl for CUDA tensors, gloo for CPU
    timeouts: SyncTimeouts = field(default_factory=SyncTimeouts)
    group: GroupOptions = field(default_factory=GroupOptions)

    def validate(self) -> None:
        if self.bucket_bytes < 64:
            raise ConfigError(f"bucket_bytes={self.bucket_bytes} is too small; use >= 64")
        if self.transport not in ("auto", "gloo", "nccl", "cuda_ipc"):
            raise ConfigError(f"transport={self.transport!r}; use auto, gloo, nccl or cuda_ipc")
        if self.striped and self.transport == "cuda_ipc":
            raise ConfigError("striped senders need a collective transport, not cuda_ipc")
        self.timeouts.validate()


def resolve_transport(transport: Transport, device: torch.device) -> str:
    """The concrete transport: NCCL between GPUs, gloo on CPU, unless set explicitly."""
    if transport != "auto":
        return transport
    return "nccl" if device.type == "cuda" else "gloo"
