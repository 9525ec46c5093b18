"""WeightPublisher: the learner's side of a weight update (call `publish` on EVERY rank).

One publish, in phases (each with its own deadline, each failure naming its phase):
  group    rebuild the weight group when membership changed or the last sync failed
  meta     rank 0 sends WeightMeta; every engine validates it and answers; then go/abort
  buckets  per bucket: FSDP all_gather (cast first) -> rank 0 (or the owning rank when
           striped) packs one flat buffer -> async broadcast on the weight group (to TP
           engine ranks: each layout's shards, sent to its engines); two slots, so
           gathering bucket k+1 overlaps sending bucket k
  done     rank 0 waits for every engine's WeightDone (sent after its last bucket landed
           and the update was applied)
Only rank 0 talks to engines; it shares decisions with the other learner ranks through
`LearnerComm`, so every rank enters the same collectives in the same order and every rank
raises the same WeightSyncError. After any failure the weight group is dropped (which
unblocks peers at once) and rebuilt under a new generation by the next publish, without
the engines that did not answer; an engine that registers again is included then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from pipeline.errors import ConfigError, WeightSyncError
from pipeline.log import get_logger
from pipeline.weights import config as deadlines
from pipeline.weights.config import MIB, PublishConfig, resolve_transport
from pipeline.weights.cuda_ipc import IpcSender, IpcSlots
from pipeline.weights.gather import BucketGatherer, pack
from pipeline.weights.group import WeightGroup, store_client
from pipeline.weights.hub import WeightHub
from pipeline.weights.learner_comm import LearnerComm
from pipeline.weights.plan import BucketPlan, TensorSpec
from pipeline.weights.reshard import pack_shards, shard_plan
from pipeline.weights.rounds import done_round, failure_text, meta_round, parse_failure
from pipeline.wire.messages import WeightMeta
from pipeline.wire.weights import GroupAssign, IpcBuffers

log = get_logger("weights.publisher")


@dataclass
class SyncReport:
    """What one publish moved: bytes per engine, seconds, per-phase seconds, GB/s."""

    version: int
    engines: list[str]
    generation: int
    transport: str
    bytes: int
    buckets: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightPublisher:
    """Publishes the current parameters as version `v` to every registered engine."""

    def __init__(
        self,
        params: nn.Module | Mapping[str, torch.Tensor],
        *,
        hub: WeightHub | None,
        config: PublishConfig = PublishConfig(),
        learner_group: dist.ProcessGroup | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._source = params
        named = self._named()
        if not named:
            raise ConfigError("nothing to publish: the model has no parameters")
        specs = [TensorSpec(n, tuple(p.shape), config.dtype) for n, p in named.items()]
        self.plan = BucketPlan.build(specs, bucket_bytes=int(config.bucket_mb * MIB))
        self.gatherer = BucketGatherer(self.plan, named)
        self.device = next(iter(named.values())).device
        self.transport = resolve_transport(config.transport, self.device)
        if self.transport == "cuda_ipc" and self.device.type != "cuda":
            raise ConfigError("transport cuda_ipc needs the learner's parameters on a GPU")
        self.comm = LearnerComm(learner_group)
        if self.comm.rank == 0 and hub is None:
            raise ConfigError("learner rank 0 needs a WeightHub to publish weights")
        self.hub = hub if self.comm.rank == 0 else None
        self.senders = self.comm.world if config.striped else 1
        self.group: WeightGroup | None = None
        self.members: list[str] = []
        self.generation = 0
        self._slots: list[torch.Tensor] = []
        self._ipc: IpcSlots | None = None
        self._dirty = True
        self._full = {s.name: s for s in specs}
        # (tp_rank, tp_size) -> that layout's plan; members' layouts when resharding
        self._shard_plans: dict[tuple[int, int], BucketPlan] = {}
        self.layouts: dict[str, tuple[int, int]] = {}
        self._shard_slots: dict[tuple[int, int], list[torch.Tensor]] = {}

    def _named(self) -> dict[str, torch.Tensor]:
        if isinstance(self._source, nn.Module):
            return dict(self._source.named_parameters())
        return dict(self._source)

    @property
    def participates(self) -> bool:
        """This learner rank is a member of the weight group (rank 0, or all when striped)."""
        return self.comm.rank < self.senders

    # ------------------------------------------------------------------ publish

    def publish(self, version: int) -> SyncReport:
        """Collective over the learner ranks; raises WeightSyncError on every rank alike."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        self.gatherer.refresh(self._named())
        head = [0, 0, 0]
        if self.hub is not None:
            self.hub.poll()
            names = self.hub.names()
            rebuild: int = self._dirty or self.hub.changed or names != self.members
            head = [len(names), int(rebuild), self.hub.generation + int(rebuild)]
        count, rebuild, generation = self.comm.bcast_ints(head)
        if count == 0:
            log.info("weight_sync_skipped", version=version, reason="no engine registered")
            return SyncReport(version, [], self.generation, self.transport, 0, 0, 0.0)
        if rebuild:  # the members' layouts change only with the members
            self._rebuild(generation)
            self.layouts = self._resharding()
        phases["group"] = time.perf_counter() - t0
        t = time.perf_counter()
        self._meta_round(version)
        phases["meta"] = time.perf_counter() - t
        t = time.perf_counter()
        failure = self._move_buckets(version)
        failed_anywhere = self.comm.any_true(failure is not None)
        phases["buckets"] = time.perf_counter() - t
        t = time.perf_counter()
        outcome = ""
        if self.hub is not None:
            limits = self.config.timeouts
            timeout = limits.bucket_timeout_s if failed_anywhere else limits.apply_timeout_s
            outcome = done_round(self.hub, self.members, version, timeout, failure, failed_anywhere)
        outcome = self.comm.bcast_text(outcome)
        phases["done"] = time.perf_counter() - t
        if outcome:
            self._fail(outcome)
        seconds = time.perf_counter() - t0
        sent = self.plan.total_bytes
        if self.layouts:  # what the engine that receives most got
            sent = max(self._shard_plan(*lay).total_bytes for lay in self.layouts.values())
        report = SyncReport(
            version,
            list(self.members),
            self.generation,
            self.transport,
            sent,
            self.plan.num_buckets,
            seconds,
            {k: round(v, 6) for k, v in phases.items()},
        )
        log.info(
            "weight_sync",
            version=version,
            engines=len(report.engines),
            bytes=report.bytes,
            buckets=report.buckets,
            seconds=round(seconds, 4),
            gbps=round(report.gbps, 3),
            transport=self.transport,
            striped=self.config.striped,
            resharded=bool(self.layouts),
            phases=report.phases,
        )
        return report

    # ------------------------------------------------------------------ resharding

    def _resharding(self) -> dict[str, tuple[int, int]]:
        """Each member's (tp_rank, tp_size) when some engine is a TP rank and the buckets go
        by group sends (gloo, NCCL); else {} (full tensors to everyone: CUDA IPC slots are
        shared by all engines). Striped, every sender learns them: each sends its own
        buckets' shards."""
        layouts: dict[str, tuple[int, int]] = {}
        if self.hub is not None and self.transport != "cuda_ipc":
            layouts = {name: self.hub.layout(name) for name in self.members}
            if all(size == 1 for _, size in layouts.values()):
                layouts = {}
        if self.senders > 1:
            text = self.comm.bcast_text(json.dumps(layouts) if layouts else "")
            layouts = {k: (v[0], v[1]) for k, v in json.loads(text or "{}").items()}
        return layouts

    def _shard_plan(self, tp_rank: int, tp_size: int) -> BucketPlan:
        key = (tp_rank, tp_size)
        if tp_size == 1:  # a whole-model engine beside TP ranks: the full buckets
            return self.plan
        if key not in self._shard_plans:
            self._shard_plans[key] = shard_plan(self.plan, tp_rank, tp_size)
        return self._shard_plans[key]

    def _fail(self, text: str) -> NoReturn:
        self._close_group()
        self._dirty = True
        f = parse_failure(text)
        log.error("weight_sync_failed", phase=f.phase, peer=f.peer, detail=f.detail)
        raise WeightSyncError(f.phase, f.peer, f.detail)

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ group

    def _rebuild(self, generation: int) -> None:
        self._close_group()
        error, spec_text = "", ""
        if self.hub is not None:
            hub = self.hub
            names = hub.names()
            t = self.config.timeouts
            base = GroupAssign(
                generation=generation,
                rank=0,
                world=self.senders + len(names),
                senders=self.senders,
                members=[f"learner-{r}" for r in range(self.senders)] + names,
                backend=self.transport,
                store_host=hub.store.host,
                store_port=hub.store.port,
                timeout_s=t.bucket_timeout_s,
                rendezvous_s=deadlines.GROUP_TIMEOUT_S,
            )
            unreachable = [
                n
                for i, n in enumerate(names)
                if not hub.send(n, msgspec.structs.replace(base, rank=self.senders + i))
            ]
            if unreachable:
                for n in unreachable:
                    hub.drop(n, "not connected when the weight group was rebuilt")
                error = failure_text("group", ", ".join(unreachable), "engine not connected")
            hub.generation, hub.changed = generation, False
            self.members = names
            spec_text = msgspec.json.encode(base).decode()
        error = self.comm.bcast_text(error)
        if error:
            self._fail(error)
        spec = msgspec.json.decode(self.comm.bcast_text(spec_text), type=GroupAssign)
        self.generation = generation
        self.members = spec.members[self.senders :]  # every learner rank knows them
        local: WeightSyncError | None = None
        if self.participates:
            try:
                self._join(msgspec.structs.replace(spec, rank=self.comm.rank))
            except WeightSyncError as exc:
                local = exc
            except Exception as exc:
                local = WeightSyncError("group", f"learner-{self.comm.rank}", str(exc))
        if self.comm.any_true(local is not None):
            text = ""
            if self.hub is not None:
                err = local or WeightSyncError("group", "learner", "another learner rank failed")
                text = failure_text("group", err.peer, str(err))
            self._fail(self.comm.bcast_text(text))
        self._dirty = False

    def _join(self, spec: GroupAssign) -> None:
        if self.transport == "cuda_ipc":
            assert self.hub is not None
            if self._ipc is None:
                self._ipc = IpcSlots(self.plan.max_bucket, self.device)
            msg = IpcBuffers(generation=spec.generation, slots=self._ipc.handles)
            for name in self.members:
                self.hub.send(name, msg)
            return
        store = (
            self.hub.store.store
            if self.hub is not None
            else store_client(spec.store_host, spec.store_port, spec.rendezvous_s)
        )
        self.group = WeightGroup.build(
            store, spec, device=self.device, options=self.config.group, wait_arrivals=True
        )

    # ------------------------------------------------------------------ meta

    def _meta_round(self, version: int) -> None:
        text = ""
        if self.hub is not None:
            meta: WeightMeta | dict[str, WeightMeta] = WeightMeta(
                version=version,
                entries=self.plan.entries(),
                bucket_sizes=list(self.plan.bucket_sizes),
                transport=self.transport,
            )
            if self.layouts:
                meta = {name: self._shard_meta(version, *lay) for name, lay in self.layouts.items()}
            text = meta_round(self.hub, self.members, meta, deadlines.META_TIMEOUT_S)
        text = self.comm.bcast_text(text)
        if text:
            self._fail(text)

    def _shard_meta(self, version: int, tp_rank: int, tp_size: int) -> WeightMeta:
        plan = self._shard_plan(tp_rank, tp_size)
        return WeightMeta(
            version=version,
            entries=plan.entries(),
            bucket_sizes=list(plan.bucket_sizes),
            transport=self.transport,
            tp_rank=tp_rank if tp_size > 1 else 0,
            tp_size=tp_size,
            p2p=True,
        )

    # ------------------------------------------------------------------ buckets

    def _buffers(self) -> list[torch.Tensor]:
        if self.transport == "cuda_ipc" and self._ipc is not None:
            return self._ipc.buffers
        if not self._slots:
            self._slots = [
                torch.empty(self.plan.max_bucket, dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
        return self._slots

    @torch.no_grad()
    def _move_buckets(self, version: int) -> tuple[str, str] | None:
        """Gather every bucket (all ranks) and send the ones this rank owns. Returns the
        first local failure as (peer, detail); after it no more weight collectives."""
        if not self.participates:
            for k in range(self.plan.num_buckets):
                self.gatherer.gather(k)
            return None
        if self.layouts:
            return self._send_shards(version)
        slots = self._buffers()
        ipc = None
        if self.transport == "cuda_ipc":
            assert self.hub is not None
            ipc = IpcSender(self.hub, self.members, version, self.config.timeouts.bucket_timeout_s)
        works: list[Any] = [None, None]
        failure: tuple[str, str] | None = None
        packed = 0
        for k, size in enumerate(self.plan.bucket_sizes):
            gathered = self.gatherer.gather(k)
            if failure is not None:
                continue  # keep joining the FSDP gathers so the other ranks do not block
            slot = k % 2
            try:
                if works[slot] is not None:
                    work, works[slot] = works[slot], None
                    work.wait()
                buf = slots[slot][:size]
                owner = k % self.senders
                if owner == self.comm.rank:
                    pack(gathered, self.plan.by_bucket[k], self.gatherer.dtype, buf)
                    packed += 1
                if ipc is not None:
                    works[slot] = ipc.send(k, slot, buf)
                else:
                    assert self.group is not None
                    works[slot] = self.group.broadcast(buf, owner)
            except Exception as exc:
                peer = exc.peer if isinstance(exc, WeightSyncError) else "weight-group"
                failure = (peer, f"bucket {k} of {self.plan.num_buckets}: {exc}")
                self._drain(works)
                self._close_group()  # peers blocked on us fail now, not at their timeout
        failure = self._drain(works) if failure is None else failure
        if self.config.striped:
            log.info("weight_stripe_sent", rank=self.comm.rank, version=version, buckets=packed)
        return failure

    def _send_shards(self, version: int) -> tuple[str, str] | None:
        """Per full bucket this rank owns (every bucket, but for striped senders), each
        layout's bucket of shards, sent to that layout's engines alone; two slots per
        layout, so packing bucket k+1 overlaps sending bucket k."""
        assert self.group is not None
        rank_of = {name: self.senders + i for i, name in enumerate(self.members)}
        by_layout: dict[tuple[int, int], list[str]] = {}
        for name, lay in self.layouts.items():
            by_layout.setdefault(lay, []).append(name)
        works: dict[tuple[int, int], list[list[Any]]] = {lay: [[], []] for lay in by_layout}
        failure: tuple[str, str] | None = None
        owned = 0
        for k in range(self.plan.num_buckets):
            gathered = self.gatherer.gather(k)
            if failure is not None or k % self.senders != self.comm.rank:
                continue  # keep joining the FSDP gathers so the other ranks do not block
            owned += 1
            try:
                for lay, names in by_layout.items():
                    plan = self._shard_plan(*lay)
                    size = plan.bucket_sizes[k]
                    if size == 0:
                        continue
                    slot = k % 2
                    for work in works[lay][slot]:
                        work.wait()
                    works[lay][slot] = []
                    buf = self._layout_slots(lay, plan.max_bucket)[slot][:size]
                    if lay[1] == 1:
                        pack(gathered, plan.by_bucket[k], self.gatherer.dtype, buf)
                    else:
                        pack_shards(gathered, plan, self._full, k, *lay, buf)
                    works[lay][slot] = [self.group.send(buf, rank_of[n]) for n in names]
            except Exception as exc:
                peer = exc.peer if isinstance(exc, WeightSyncError) else "weight-group"
                failure = (peer, f"bucket {k} of {self.plan.num_buckets}: {exc}")
                self._close_group()
        pending = [w for pair in works.values() for slot in pair for w in slot]
        if self.config.striped:
            log.info("weight_stripe_sent", rank=self.comm.rank, version=version, buckets=owned)
        return self._drain(pending) if failure is None else failure

    def _layout_slots(self, lay: tuple[int, int], nbytes: int) -> list[torch.Tensor]:
        slots = self._shard_slots.get(lay)
        if slots is None:
            slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self._shard_slots[lay] = slots
        return slots

    def _drain(self, works: list[Any]) -> tuple[str, str] | None:
        first = None
        for i, work in enumerate(works):
            works[i] = None
            if work is None:
                continue
            try:
                work.wait()
            except Exception as exc:
                peer = exc.peer if isinstance(exc, WeightSyncError) else "weight-group"
                first = first or (peer, f"last buckets: {exc}")
        if first is not None:
            self._close_group()
        return first

    # ------------------------------------------------------------------ done

    def close(self) -> None:
        self._close_group()
