"""Settings of weight sync: bucket layout, rollout dtype, transport, per-phase timeouts.

Every phase has its own deadline because each one fails differently: a rendezvous waits for
engines to show up, metadata waits for validation, a bucket waits on a collective, and the
final ack waits for an engine's safe point. One global timeout would either be too short
for applying a 7B update or far too long to notice a dead engine during a short bucket.

A run config sets `learner.weights.bucket_mb`; `weights/link.py` copies it here, with the
deadlines below (constants: no run tunes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from pipeline.errors import ConfigError

Transport = Literal["auto", "gloo", "nccl", "cuda_ipc"]
MIB = 1 << 20

# seconds for the engines to arrive at a new weight group's rendezvous (after a member came
# or went)
GROUP_TIMEOUT_S = 60.0
# seconds for every engine to validate an update's WeightMeta and answer, and for an engine
# that accepted to hear go/abort; a silent engine is left out of that update
META_TIMEOUT_S = 30.0
# seconds one bucket's collective may take (also the group's op timeout)
BUCKET_TIMEOUT_S = 120.0
# seconds for every engine to apply an update at its next safe point and acknowledge it
APPLY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SyncTimeouts:
    """The deadlines a publisher or receiver is built with (a run's: the constants above;
    the group's and the metadata's are read from there directly)."""

    bucket_timeout_s: float = BUCKET_TIMEOUT_S  # one bucket's collective (the group's ops)
    apply_timeout_s: float = APPLY_TIMEOUT_S  # an engine applies the update and acks

    def validate(self) -> None:
        for name in ("bucket_timeout_s", "apply_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"learner.weights.{name} must be > 0 (seconds)")


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

    bucket_mb: float = 1024.0  # one broadcast bucket (MiB, as learner.weights.bucket_mb)
    dtype: torch.dtype = torch.bfloat16  # the rollout dtype; cast before any gather
    striped: bool = False  # every learner rank broadcasts the buckets it owns
    transport: Transport = "auto"  # auto: nccl for CUDA tensors, gloo for CPU
    timeouts: SyncTimeouts = field(default_factory=SyncTimeouts)
    group: GroupOptions = field(default_factory=GroupOptions)

    def validate(self) -> None:
        if not self.bucket_mb * MIB >= 64:
            raise ConfigError("learner.weights.bucket_mb must be at least 64 bytes' worth")
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
