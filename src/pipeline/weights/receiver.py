"""WeightReceiver: an engine rank's side of weight sync, serving in its own thread.

Protocol on the engine's DEALER (one per engine rank; a TP engine runs one receiver per TP
rank, each a weight-group member that keeps its own slice):
  -> Hello(service=name)                      register (again after a restart or a drop)
  <- GroupAssign / IpcBuffers                 join generation g of the weight group
  <- WeightMeta                               validate against our parameters FIRST
  -> MetaAccepted | MetaRejected(problems)
  <- SyncGo(proceed)                          every engine answered; move the bytes or not
     ... broadcasts (or CUDA IPC ready/free per bucket) into staging tensors ...
  -> WeightDone(ok, seconds, error)           only after the last bucket landed and the
                                              engine serves the update (its Future resolved)
Any failure or phase timeout (meta, buckets, apply) leaves the old weights and version
serving and answers WeightDone(ok=False, error="<phase>: ...").

The staging tensors are the engine's only staging copy of the weights: `apply` hands them
to the engine, which copies them into its live parameters at its own safe point
(engines/weights.py) while this thread waits, so they are never overwritten before that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from typing import Any

import torch
import zmq
from torch import nn

from pipeline.errors import MetadataRejected
from pipeline.log import get_logger
from pipeline.transport.channel import connect, new_identity
from pipeline.weights import config as deadlines
from pipeline.weights.config import GroupOptions, SyncTimeouts
from pipeline.weights.control import Link, Received
from pipeline.weights.cuda_ipc import open_handle
from pipeline.weights.group import WeightGroup, store_client
from pipeline.weights.staging import Staging
from pipeline.weights.validate import Layout, ParamSpec, params_of, validate_meta
from pipeline.wire.messages import Hello, Shutdown, WeightDone, WeightMeta
from pipeline.wire.weights import (
    BucketFree,
    BucketReady,
    GroupAssign,
    IpcBuffers,
    MetaAccepted,
    MetaRejected,
    Pause,
    Removed,
    SyncGo,
)

HELLO_EVERY_S = 2.0  # an idle receiver re-registers this often

log = get_logger("weights.receiver")
# the engine's take of a landed update: (staging tensors by name, version) -> None once
# applied, or a Future resolved once applied (cancelled when apply_timeout_s runs out). The tensors
# are reused by the next update: the engine copies them before resolving.
ApplyFn = Callable[[dict[str, torch.Tensor], int], "Future[int] | None"]
# (version, bucket, number of buckets) after a bucket landed: progress metrics, tests
OnBucket = Callable[[int, int, int], None]
# the engine's pause until the given version is applied (turns on a shared device)
OnPause = Callable[[int], None]


class _Abort(Exception):
    """The learner withdrew this engine mid-sync (Removed)."""


class WeightReceiver:
    """Receives updates for one engine rank and hands each complete one to `apply`.

    `params` are this rank's own parameters (its TP slice); metadata is checked against
    them with full shapes derived by `tp.full_shape`. Deadlines: `META_TIMEOUT_S` for the
    learner's go/abort after we accepted, the group's collective timeout (the learner's
    `bucket_timeout_s`, from GroupAssign) per broadcast, `bucket_timeout_s` per CUDA IPC
    bucket, `apply_timeout_s` for the engine's safe point. Run it with `start()` (own thread) or drive it with `run_until`.
    """

    def __init__(
        self,
        name: str,
        endpoint: str,
        params: nn.Module | Mapping[str, ParamSpec],
        apply: ApplyFn,
        *,
        replica: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | str | None = None,
        timeouts: SyncTimeouts = SyncTimeouts(),
        options: GroupOptions = GroupOptions(),
        run_id: str = "",
        version: int = -1,
        on_bucket: OnBucket | None = None,
        on_pause: OnPause | None = None,
    ) -> None:
        if isinstance(params, nn.Module):
            first = next(params.parameters(), None)
            device = device or (first.device if first is not None else "cpu")
            params = params_of(params)
        self.name = name
        self.replica = replica
        self.expected = dict(params)
        self.device = torch.device(device or "cpu")
        self.tp_size = tp_size
        self.apply_fn = apply
        self.timeouts = timeouts
        self.options = options
        self.on_bucket = on_bucket
        self.on_pause = on_pause
        self.version = version  # the version serving now
        self.received_bytes = 0  # bucket bytes of the last update (its shards when resharded)
        self.last_error = ""
        self.staging = Staging(self.expected, device=self.device, tp_rank=tp_rank, tp_size=tp_size)
        self.ctx = zmq.Context()
        self.link = Link(
            self.ctx, zmq.DEALER, sender=name, run_id=run_id, identity=new_identity(name)
        )
        connect(self.link.sock, endpoint)
        self.group: WeightGroup | None = None
        self.assign: GroupAssign | None = None  # the latest group assignment
        self._stores: dict[tuple[str, int], Any] = {}
        self._slots: list[torch.Tensor] = []
        self._ipc_slots: list[torch.Tensor] = []
        self._requeued: deque[Received] = deque()
        self._accepted: tuple[WeightMeta, Layout] | None = None  # the last validated meta
        self._refused = False  # the hub refused our connection (logged once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def register(self) -> None:
        hello = Hello(
            service=self.name,
            replica=self.replica,
            pid=os.getpid(),
            host=socket.gethostname(),
            tp_rank=self.staging.tp_rank,
            tp_size=self.tp_size,
        )
        if not self.link.send(hello) and not self._refused:
            self._refused = True  # said once; the hello is tried again while idle
            log.error(
                "weights_hub_refused",
                engine=self.name,
                detail="the learner's weight hub refused this engine's connection: its "
                "host needs the run's keys (run.keys_dir, with authorized/) too",
            )

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve, name=f"weights-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def serve(self) -> None:
        """Register, then handle control messages until stopped (the receiver thread)."""
        self.register()
        try:
            self.run_until(lambda: False, None)
        finally:
            self.close()

    def run_until(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        """Handle control messages in the calling thread until `done()` or stop/timeout;
        whether `done()` held (for engines that drive the receiver from their own loop)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_hello = time.monotonic()
        while not self._stop.is_set() and not done():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return False
            rcv = self._requeued.popleft() if self._requeued else self.link.recv(0.1)
            if rcv is not None:
                self.handle(rcv)
            elif now - last_hello > HELLO_EVERY_S:
                # idle: say hello again; the hub ignores a repeat, but a restarted learner
                # (a new hub that never heard of us) registers us and sends current weights
                self.register()
                last_hello = now
        return done()

    def close(self) -> None:
        self._close_group()
        with contextlib.suppress(Exception):  # goodbye: the learner stops waiting for us
            self.link.send(Shutdown(reason=f"{self.name} leaving"))
        self.link.close()
        self.ctx.term()

    def handle(self, rcv: Received) -> None:
        ctl, body = rcv.control, rcv.message.body
        if isinstance(ctl, GroupAssign):
            self._join(ctl)
        elif isinstance(ctl, IpcBuffers):
            self._ipc_slots = [open_handle(h) for h in ctl.slots]
        elif isinstance(ctl, Removed):
            self._close_group()
            log.warning("weights_dropped", engine=self.name, reason=ctl.reason, rejoin=ctl.rejoin)
            if ctl.rejoin:
                self.register()
        elif isinstance(ctl, Pause):
            if self.on_pause is not None:
                self.on_pause(ctl.version)
        elif isinstance(body, WeightMeta):
            self._sync(body, rcv.message.header.seq)
        elif isinstance(body, Shutdown):
            self._stop.set()

    # ------------------------------------------------------------------ group

    def _join(self, spec: GroupAssign) -> None:
        self._close_group()
        self.assign = spec
        if spec.backend == "cuda_ipc":
            return  # the slots come next, in IpcBuffers
        try:
            key = (spec.store_host, spec.store_port)
            if key not in self._stores:
                self._stores[key] = store_client(*key, spec.rendezvous_s)
            self.group = WeightGroup.build(
                self._stores[key], spec, device=self.device, options=self.options
            )
        except Exception as exc:  # the learner names us when it times out
            log.error("weight_group_join_failed", engine=self.name, error=str(exc))
            self.group = None

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ one update

    def _sync(self, meta: WeightMeta, attempt: int) -> None:
        try:
            layout = self._validate(meta)
        except MetadataRejected as exc:
            self.last_error = f"meta: {exc}"
            log.error(
                "weight_meta_rejected", engine=self.name, version=meta.version, error=str(exc)
            )
            self.link.send(
                MetaRejected(
                    version=meta.version, attempt=attempt, error=str(exc), problems=exc.problems
                )
            )
            return
        self.link.send(MetaAccepted(version=meta.version, attempt=attempt))
        self.received_bytes = layout.total_bytes
        go = self._wait_go(attempt)
        if go is None or not go.proceed:
            return
        t0 = time.perf_counter()
        phase = "buckets"
        try:
            if layout.transport == "cuda_ipc":
                self._receive_ipc(layout)
            else:
                self._receive(layout)
            phase = "apply"
            self._apply(layout.version)
        except Exception as exc:
            if phase == "buckets":
                self._close_group()  # our peers must not wait on us; the learner rebuilds
            self._done(layout.version, t0, f"{phase}: {exc}")
            return
        self.version = layout.version
        self._done(layout.version, t0, "")

    def _validate(self, meta: WeightMeta) -> Layout:
        """`validate_meta`, or the last accepted layout under this version when the metadata
        equals the last accepted one but for its version (the learner sends the same layout
        every sync, and checking the 0.5B model's 290 entries in Python is slow)."""
        last = self._accepted
        if (
            last is not None
            and (meta.transport, meta.bucket_sizes) == (last[0].transport, last[0].bucket_sizes)
            and meta.entries == last[0].entries
        ):
            return dataclasses.replace(last[1], version=meta.version)
        layout = validate_meta(
            meta, self.expected, tp_rank=self.staging.tp_rank, tp_size=self.tp_size
        )
        self._accepted = (meta, layout)
        return layout

    def _done(self, version: int, t0: float, error: str) -> None:
        seconds = time.perf_counter() - t0
        if error:
            self.last_error = error
            log.error("weight_sync_failed", engine=self.name, version=version, error=error)
        else:
            log.info(
                "weight_sync_applied",
                engine=self.name,
                version=version,
                seconds=seconds,
                bytes=self.received_bytes,
            )
        self.link.send(
            WeightDone(
                version=version, engine=self.name, ok=not error, seconds=seconds, error=error
            )
        )

    def _wait_go(self, attempt: int) -> SyncGo | None:
        deadline = time.monotonic() + deadlines.META_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            rcv = self.link.recv(left)
            if rcv is None:
                continue
            if isinstance(rcv.control, SyncGo) and rcv.control.attempt == attempt:
                return rcv.control
            self._requeued.append(rcv)  # anything else is handled after this sync
            if isinstance(rcv.control, Removed | GroupAssign) or isinstance(
                rcv.message.body, WeightMeta
            ):
                return None
        self.last_error = f"meta: no go/abort within {deadlines.META_TIMEOUT_S:.1f}s"
        log.error("weight_sync_failed", engine=self.name, error=self.last_error)
        return None

    def _buffers(self, nbytes: int) -> list[torch.Tensor]:
        if not self._slots or self._slots[0].numel() < nbytes:
            self._slots = [
                torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        return self._slots

    def _receive(self, layout: Layout) -> None:
        group = self.group
        if group is None:
            raise RuntimeError("not a member of a weight group (its build failed)")
        slots = self._buffers(max(layout.bucket_sizes, default=0))
        pending: deque[tuple[int, Any, torch.Tensor]] = deque()
        posted = 0
        for k, size in enumerate(layout.bucket_sizes):
            if layout.p2p and size == 0:  # our own shards only: an empty bucket is not sent
                continue
            buf = slots[posted % 2][:size]  # alternate over the buckets that come
            posted += 1
            owner = group.owner(k)  # the learner rank that sends bucket k
            work = group.recv(buf, owner) if layout.p2p else group.broadcast(buf, owner)
            pending.append((k, work, buf))
            if len(pending) == 2:
                self._land(layout, *pending.popleft())
        while pending:
            self._land(layout, *pending.popleft())

    def _land(self, layout: Layout, bucket: int, work: Any, buf: torch.Tensor) -> None:
        work.wait()
        self.staging.land(layout, bucket, buf)
        if self.on_bucket is not None:
            self.on_bucket(layout.version, bucket, len(layout.bucket_sizes))

    def _receive_ipc(self, layout: Layout) -> None:
        if not self._ipc_slots:
            raise RuntimeError("no CUDA IPC buffers were shared with this engine")
        for k in range(len(layout.bucket_sizes)):
            ready = self._wait_ready(layout.version, k)
            buf = self._ipc_slots[ready.slot][: ready.nbytes]
            self.staging.land(layout, k, buf)
            torch.cuda.current_stream(buf.device).synchronize()  # copied out: slot reusable
            self.link.send(BucketFree(version=layout.version, bucket=k, slot=ready.slot))
            if self.on_bucket is not None:
                self.on_bucket(layout.version, k, len(layout.bucket_sizes))

    def _wait_ready(self, version: int, bucket: int) -> BucketReady:
        deadline = time.monotonic() + self.timeouts.bucket_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            rcv = self.link.recv(left)
            if rcv is None:
                continue
            ctl = rcv.control
            if isinstance(ctl, BucketReady) and (ctl.version, ctl.bucket) == (version, bucket):
                return ctl
            if isinstance(ctl, Removed | GroupAssign) or isinstance(rcv.message.body, WeightMeta):
                self._requeued.append(rcv)
                raise _Abort("the learner moved on")
        raise TimeoutError(
            f"bucket {bucket} not ready within {self.timeouts.bucket_timeout_s:.1f}s"
        )

    def _apply(self, version: int) -> None:
        result = self.apply_fn(self.staging.tensors, version)
        if not isinstance(result, Future):
            return
        try:
            result.result(timeout=self.timeouts.apply_timeout_s)
        except TimeoutError:
            if result.cancel():  # withdrawn: a later safe point skips it
                raise TimeoutError(
                    f"not applied within {self.timeouts.apply_timeout_s:.1f}s; old version kept"
                ) from None
            result.result()  # already being copied: wait for the copy to end
        except CancelledError:
            raise RuntimeError(
                "the engine withdrew the update (closing); old version kept"
            ) from None
