"""The weight group: learner sender rank(s) + every engine rank, apart from the FSDP group.

It is built straight from a `TCPStore` (hosted by learner rank 0) through a `PrefixStore`
per generation, as a bare `ProcessGroupGloo` / `ProcessGroupNCCL` backend: the default
process group is never touched, so engines need no `init_process_group` and the learner's
FSDP world is unaffected. It is stateless across generations: when engines join or leave,
every member drops its backend and builds generation g+1 under a fresh prefix.
Collectives are called on the backend object directly (`Backend.broadcast`), which needs
no registration in torch.distributed's world.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import ConfigError, WeightSyncError
from pipeline.log import get_logger
from pipeline.weights.config import GroupOptions
from pipeline.wire.weights import GroupAssign

log = get_logger("weights.group")
# seconds torch polls a non-blocking NCCL init before it fails (read once per process)
CONNECT_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


class StoreHost:
    """The rendezvous store, hosted once by learner rank 0 and reused by every generation."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> None:
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.host = host
        self.port = int(self.store.port)


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the learner's store (keep it: re-connecting costs a round trip)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _gloo(store: dist.Store, spec: GroupAssign, options: GroupOptions) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=spec.timeout_s)
    if options.hostname:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=options.hostname)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, spec.rank, spec.world, opts)


def _nccl(store: dist.Store, spec: GroupAssign, device: torch.device) -> Any:
    """Connect this member's NCCL communicator within the group's deadline.

    A blocking NCCL init waits without end for a member that arrived and then died (or
    stalled) before connecting, and cannot be aborted: its communicator handle exists only
    once the init returns. So the communicator is made non-blocking (`config.blocking = 0`:
    torch polls NCCL's init, abortable, up to TORCH_NCCL_NONBLOCKING_TIMEOUT seconds, which
    is set here to `rendezvous_s` unless the environment sets it; torch reads it once per
    process) and one 1-element broadcast completes the connect inside `build`. A connect
    that fails or runs past the deadline aborts the backend and raises WeightSyncError
    (phase "group", peer: the other members, since NCCL does not say which one is missing).
    """
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise ConfigError("this torch build has no NCCL; use transport gloo on CPU")
    os.environ.setdefault(CONNECT_TIMEOUT_ENV, str(max(1, math.ceil(spec.rendezvous_s))))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=spec.timeout_s)
    opts.config.blocking = 0
    torch.cuda.set_device(device)
    pg = dist.ProcessGroupNCCL(store, spec.rank, spec.world, opts)
    try:
        pg.eager_connect_single_device(device)
        _broadcast(pg, torch.zeros(1, device=device), 0, spec.timeout_s).wait()
    except Exception as exc:  # DistBackendError / DistStoreError: NCCL names no member
        _abort(pg)
        others = ", ".join(m for r, m in enumerate(spec.members) if r != spec.rank)
        cause = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise WeightSyncError(
            "group",
            others,
            f"the NCCL connect of weight group generation {spec.generation} did not complete "
            f"within {os.environ[CONNECT_TIMEOUT_ENV]}s (a member arrived but did not connect: "
            f"dead or stuck): {cause}",
        ) from exc
    return pg


def _broadcast(backend: Any, tensor: torch.Tensor, src: int, timeout_s: float) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return backend.broadcast([tensor], opts)


def _abort(backend: Any) -> None:
    """Abort `backend` so that peers blocked on it fail at once (best effort)."""
    try:
        backend.abort()
    except Exception as exc:  # not every backend/build implements abort
        log.debug("weight_group_abort_failed", error=str(exc))


def device_key(device: torch.device) -> str:
    """What names `device` across processes and hosts: a GPU's UUID; "" for other devices."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def announce(prefix: dist.Store, rank: int, gpu: str) -> None:
    """Rank `rank` arrived at this generation: its pid and its GPU's key ("" for none)."""
    prefix.set(f"arrived/{rank}", f"{os.getpid()} {gpu}")


def shared_gpus(keys: dict[int, str], members: list[str]) -> list[list[str]]:
    """The member names of each GPU (non-empty key) that more than one rank holds."""
    holders: dict[str, list[str]] = {}
    for rank, key in sorted(keys.items()):
        if key:
            holders.setdefault(key, []).append(members[rank])
    return [names for names in holders.values() if len(names) > 1]


def check_one_rank_per_gpu(prefix: dist.Store, spec: GroupAssign) -> None:
    """NCCL takes one rank per GPU: with several on one GPU a member's connect can wait
    without end (three engine ranks on one GPU and the learner on another did). Every
    member reads the GPUs all members announced on arrival and raises the same error,
    naming those that share one, before connecting."""
    keys = {}
    for rank in range(spec.world):
        _, _, key = prefix.get(f"arrived/{rank}").decode().partition(" ")
        keys[rank] = key
    shared = shared_gpus(keys, spec.members)
    if shared:
        names = "; ".join(" and ".join(group) for group in shared)
        raise WeightSyncError(
            "group",
            ", ".join(name for group in shared for name in group),
            f"NCCL takes one rank per GPU, but {names} share one; give each rank its own "
            "GPU, or use transport cuda_ipc where the learner and its engines share one GPU",
        )


class WeightGroup:
    """One generation of the weight group, as seen by one member."""

    def __init__(self, backend: Any, spec: GroupAssign, device: torch.device) -> None:
        self.backend = backend
        self.spec = spec
        self.device = device

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def generation(self) -> int:
        return self.spec.generation

    def owner(self, bucket: int) -> int:
        """Group rank that broadcasts `bucket`: round robin over the learner senders."""
        return bucket % self.spec.senders

    @classmethod
    def build(
        cls,
        store: dist.Store,
        spec: GroupAssign,
        *,
        device: torch.device,
        options: GroupOptions = GroupOptions(),
        wait_arrivals: bool = True,
    ) -> WeightGroup:
        """Join generation `spec.generation`. With `wait_arrivals` every member first waits
        (up to `rendezvous_s`) until all members announced themselves in the store: a
        missing engine is then named instead of surfacing as an anonymous connect timeout,
        and the backend's own connect runs only once everyone is there; for NCCL, only once
        no two members hold one GPU (`check_one_rank_per_gpu`)."""
        prefix = dist.PrefixStore(f"weights/g{spec.generation}/", store)
        announce(prefix, spec.rank, device_key(device) if spec.backend == "nccl" else "")
        if wait_arrivals:
            deadline = time.monotonic() + spec.rendezvous_s
            missing = list(range(spec.world))
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not prefix.check([f"arrived/{r}"])]
                if missing:
                    time.sleep(0.01)
            if missing:
                names = ", ".join(spec.members[r] for r in missing)
                raise WeightSyncError(
                    "group",
                    names,
                    f"did not arrive at weight group generation {spec.generation} within "
                    f"{spec.rendezvous_s:.1f}s",
                )
            if spec.backend == "nccl":  # gloo members announce no GPU
                check_one_rank_per_gpu(prefix, spec)
        t0 = time.perf_counter()
        if spec.backend == "gloo":
            backend = _gloo(prefix, spec, options)
        elif spec.backend == "nccl":
            backend = _nccl(prefix, spec, device)
        else:
            raise ConfigError(f"weight group backend {spec.backend!r}; use gloo or nccl")
        log.info(
            "weight_group_built",
            generation=spec.generation,
            rank=spec.rank,
            world=spec.world,
            backend=spec.backend,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return cls(backend, spec, device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        """Async broadcast from group rank `src`; returns the backend's Work."""
        return _broadcast(self.backend, tensor, src, self.spec.timeout_s)

    def send(self, tensor: torch.Tensor, dst: int) -> Any:
        """Async send to group rank `dst` alone (a resharded bucket); the backend's Work."""
        return self.backend.send([tensor], dst, 0)

    def recv(self, tensor: torch.Tensor, src: int) -> Any:
        return self.backend.recv([tensor], src, 0)

    def close(self) -> None:
        """Drop the backend: peers blocked on us fail at once instead of at their timeout."""
        backend, self.backend = self.backend, None
        if backend is None:
            return
        _abort(backend)
        del backend
