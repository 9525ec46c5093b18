"""The ranks of one sharded trainer service: rank 0 serves, the other ranks follow it.

Launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the
environment), a learner or critic with `services.ROLE.fsdp_size = N > 1` is ONE
data-parallel FSDP2 service of N processes. Rank 0 alone talks to the controller and the
queues (hello, input queue, acks, step reports, metrics, the weight hub). Every operation
that runs collectives (building the sharded model, resuming, a train step, a checkpoint, a
weight publish, the last save) is a `RankCommand`: rank 0 broadcasts it, then runs its part;
the other ranks wait for the next command and run the same code on the same inputs
(`execute`), so every rank enters the same collectives in the same order. Rank 0 sends one
command at a time: a publish that a newly registered engine triggers between steps cannot
interleave with a train step.

Commands travel on a gloo group of their own with a long timeout: a follower waits for the
next one as long as rank 0 waits for data, while the training group keeps the trainer's
timeout. A follower leaves on STOP (sent by rank 0 after its last save), when rank 0's
process is gone (gloo reports the closed connection; torchrun then stops the rest), or
with its torchrun agent (parent-death signal). SIGTERM reaches every rank (torchrun
forwards it) while rank 0 still needs the others for its last checkpoint, so a follower
gives rank 0 `supervisor.stop_timeout_s` to send STOP before it leaves on its own.

Multi-node: the run directory (the model the controller made, checkpoints) must be on a
filesystem every node sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from pipeline.config import PipelineConfig
from pipeline.config.schema import TRAINER_ROLES
from pipeline.errors import ConfigError, RankGroupBroken, RankMismatch
from pipeline.log import bind_process, configure_logging, get_logger
from pipeline.training.config import role_device
from pipeline.wire import codec
from pipeline.wire.messages import Experience, RankCommand, RankOp
from pipeline.wire.samples import GroupArrays, read_group, write_group

T = TypeVar("T")

# how long a follower waits for rank 0's next command (rank 0 may wait that long for data)
COMMAND_TIMEOUT = datetime.timedelta(days=7)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankCommand)

log = get_logger("ranks")


def launched_ranks() -> int:
    """torchrun's WORLD_SIZE; 1 for a process started without it."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError as err:
        raise ConfigError(f"environment variable WORLD_SIZE={raw!r} must be an integer") from err


def check_world(config: PipelineConfig, role: str, world: int) -> None:
    """The ranks launched must be the profile's: `services.ROLE.fsdp_size` for a trainer,
    `services.rollout.tp` for the built-in engine."""
    want = config.ranks_per_replica(role)
    if world == want:
        return
    key = "fsdp_size" if role in TRAINER_ROLES else "tp"
    if want == 1 and role not in TRAINER_ROLES:
        raise RankMismatch(
            f"a {role} replica is one process here but was started with WORLD_SIZE={world}; "
            f"start one process per replica (`pipeline service {role}`), not torchrun"
        )
    if world == 1:
        raise RankMismatch(
            f"services.{role}.{key} = {want} needs {want} ranks: start the {role} with "
            f"`torchrun --nproc-per-node {want} -m services.{role} ...` (`pipeline run` and "
            f"`pipeline deploy render` do), or set --services.{role}.{key} 1"
        )
    raise RankMismatch(
        f"torchrun started {world} ranks of the {role} but services.{role}.{key} = "
        f"{want}; launch {want} ranks in all (--nproc-per-node x --nnodes) or set "
        f"--services.{role}.{key} {world}"
    )


def join(config: PipelineConfig, role: str, replica: int) -> RankLink | None:
    """Under torchrun: join the service's process group (gloo on CPU, nccl on CUDA with
    device cuda:LOCAL_RANK) and its command group. None for a single-process service."""
    world = launched_ranks()
    check_world(config, role, world)
    if world == 1:
        return None
    import torch

    from pipeline.training.distributed import init_distributed

    _die_with_parent()
    configure_logging()
    rank = int(os.environ.get("RANK", "0"))
    bind_process(service=role, replica=replica, rank=rank)
    info = init_distributed(device=role_device(config, role))
    if info.device.type == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if torch.cuda.device_count() < local_world:
            raise RankMismatch(
                f"{local_world} {role} ranks on this node see {torch.cuda.device_count()} "
                f"GPUs; set services.{role}.devices_per_replica = {local_world} (one GPU per "
                "rank) and give the pool that many devices"
            )
    link = RankLink(info)
    log.info(
        "rank_joined",
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        device=str(info.device),
        backend=_backend(),
    )
    return link


def _backend() -> str:
    import torch.distributed as dist

    return str(dist.get_backend())


def _die_with_parent() -> None:
    """Go with the torchrun agent: a rank orphaned by a SIGKILLed agent would otherwise
    hold its GPU and sockets until the run's next incarnation collides with it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))


class RankLink:
    """The command channel between rank 0 of a sharded service and its other ranks."""

    def __init__(self, info: Any) -> None:
        import torch.distributed as dist

        self.info = info
        self.rank: int = info.rank
        self.world: int = info.world_size
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self._lock = threading.Lock()
        self.broken = False
        self.stopped = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ rank 0

    def lead(
        self,
        command: RankCommand,
        run: Callable[[], T],
        *,
        agreed: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Rank 0: send `command` to the other ranks, then run this rank's part of it.
        Blocking, one command at a time. An exception other than the `agreed` ones (those
        every rank raises alike, e.g. WeightSyncError) may have left the other ranks in a
        collective: no command is sent after it."""
        self.send(command)
        try:
            return run()
        except agreed:
            raise
        except BaseException:
            self.broken = True
            raise

    def send(self, command: RankCommand) -> None:
        """Rank 0: send `command` to the other ranks (blocking); refused once the group is
        broken or stopped. The caller runs this rank's part next, in the same order."""
        with self._lock:
            if self.broken or self.stopped:
                state = "stopped" if self.stopped else "broken by a failed collective"
                raise RankGroupBroken(
                    f"rank group {state}: cannot run {RankOp(command.op).name}; restart the "
                    "service (torchrun starts every rank again)"
                )
            self._send(command)

    def stop(self) -> None:
        """Rank 0, at the end: let the other ranks go. Idempotent; nothing is sent after a
        failed collective (the other ranks go with rank 0's process then)."""
        with self._lock:
            if self.broken or self.stopped:
                return
            self.stopped = True
            self._send(RankCommand(op=RankOp.STOP))

    def _send(self, command: RankCommand) -> None:
        assert self.is_leader, "only rank 0 sends commands"
        self._broadcast(_encoder.encode(command))

    # ------------------------------------------------------------------ other ranks

    def receive(self) -> RankCommand:
        """The next command of rank 0 (blocking)."""
        assert not self.is_leader, "rank 0 sends commands"
        return _decoder.decode(self._broadcast(b""))

    def _broadcast(self, data: bytes) -> bytes:
        import torch
        import torch.distributed as dist

        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, group_src=0, group=self.group)
        n = int(size.item())
        if self.is_leader:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, group_src=0, group=self.group)
        return data if self.is_leader else buf.numpy().tobytes()

    # ------------------------------------------------------------------ both

    def close(self) -> None:
        """Leave the process group together (a barrier first; see teardown_distributed)."""
        from pipeline.training.distributed import teardown_distributed

        if not self.broken:
            teardown_distributed()
            log.info("rank_left", rank=self.rank)


class TrainerThread:
    """The one thread that runs every call of a trainer, off the event loop; on rank 0 of
    a sharded service it sends the other ranks each call's command first.

    A pool thread per call would do for the arithmetic, but CUDA graph trees
    (`trainer.compile_mode = "reduce-overhead"`) belong to the thread that recorded them: a
    trainer hopping between pool threads would record its graphs again, in a new memory pool,
    on each thread it lands on."""

    def __init__(self, name: str, ranks: RankLink | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ranks = ranks if ranks is not None and ranks.is_leader else None
        self._one = asyncio.Lock()

    @property
    def has_followers(self) -> bool:
        """Whether calls send a command to other ranks: build one only then."""
        return self.ranks is not None

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        command: RankCommand | None = None,
        agreed: tuple[type[BaseException], ...] = (),
    ) -> T:
        """`fn(*args)` on the thread, in a copy of the caller's context (log bindings such
        as the rank travel with it, as with asyncio.to_thread). Sharded, `command` (what
        makes the other ranks run the same) is sent first; one call at a time, so calls
        from several tasks cannot interleave a command with another call's part. An
        exception other than the `agreed` ones (which every rank raises alike) may have left
        the other ranks in a collective: the group then takes no more commands."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        async with self._one:
            if self.ranks is not None and command is not None:
                await loop.run_in_executor(self._pool, self.ranks.send, command)
            try:
                return await loop.run_in_executor(self._pool, context.run, fn, *args)
            except agreed:
                raise
            except BaseException:
                if self.ranks is not None:
                    self.ranks.broken = True
                raise

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def encode_groups(groups: list[GroupArrays]) -> list[list[bytes]]:
    """Sample groups as wire frames (the queue's own encoding) for the other ranks."""
    out = []
    for seq, group in enumerate(groups):
        body, pack = write_group(group, Experience)
        frames = codec.encode(body, run_id="", sender="rank-0", seq=seq, tensors=pack)
        out.append([f if isinstance(f, bytes) else memoryview(f).tobytes() for f in frames])
    return out


def decode_groups(frames: list[list[bytes]]) -> list[GroupArrays]:
    return [read_group(codec.decode(group)) for group in frames]
