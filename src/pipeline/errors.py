"""Typed errors. Each message says what went wrong and how to fix it."""

from __future__ import annotations

# a process's exit code when its config is refused: the supervisor does not restart it
EXIT_CONFIG = 2


class PipelineError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(PipelineError):
    """A profile or override is invalid; the message names the key and the fix."""


class UnknownPool(ConfigError):
    """A service was placed (`--pool`) on a pool the profile does not define."""


class PlacementConflict(ConfigError):
    """A replica's `--pool` is on another host than the run places its role: its peers,
    which find it from the run's config, would look for it at the wrong address."""


class SchemaMismatch(PipelineError):
    """A message could not be decoded: malformed, unknown version, wrong type, oversized."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class HandshakeTimeout(PipelineError):
    """A peer did not complete hello -> config -> ready in time."""


class HandshakeRefused(ConfigError):
    """The controller refused this process's connection: it has no credentials the run
    takes (keys across hosts, the run's secret on its host), or ones the run does not know.
    A restart cannot mend that, so the service exits as for a refused config."""


class TransportClosed(PipelineError):
    """The channel was closed while an operation was waiting on it."""


class WeightSyncError(PipelineError):
    """A weight update failed; the message names the phase and the peer."""

    def __init__(self, phase: str, peer: str, detail: str) -> None:
        super().__init__(f"weight sync failed in phase {phase!r} with peer {peer!r}: {detail}")
        self.phase = phase
        self.peer = peer


class MetadataRejected(PipelineError):
    """Weight-update metadata does not match the receiver's parameters."""

    def __init__(self, problems: dict[str, list[str]]) -> None:
        lines = [f"{kind}: {', '.join(sorted(names))}" for kind, names in problems.items() if names]
        super().__init__("weight metadata refused; " + "; ".join(lines))
        self.problems = problems


class RecordingError(PipelineError):
    """A recorded queue file is truncated, corrupt or of another schema version."""


class InsecureEndpoint(ConfigError):
    """A non-loopback address without CURVE keys (and run.allow_insecure not set)."""


class JournalError(PipelineError):
    """The controller's run journal is damaged or belongs to another run."""


class RankMismatch(ConfigError):
    """A trainer service was started with another number of ranks than the profile's
    `services.ROLE.fsdp_size` (torchrun's WORLD_SIZE), or a role that does not shard was
    started under torchrun."""


class RankGroupBroken(PipelineError):
    """A collective operation failed on rank 0 of a sharded service: the other ranks may be
    stuck in it, so no further command is sent to them (the service must restart)."""
