"""Weight-sync bench: seconds and GB/s to publish every weight of a model shape.

    python -m bench.weight_sync [--json OUT] [--shape tiny|0.5b|7b] [--device cpu|cuda]
        [--learners N] [--engines M] [--bucket-mb B] [--repeats R] [--striped]

Real processes: N learner ranks hold random fp32 weights of the shape (FSDP2-style dim-0
shards as DTensors when N > 1; plain tensors built from the shape, no model needed) and
publish them as bfloat16 through `WeightPublisher` to M engine processes (`WeightReceiver`).
In the same run, with the same tensors and group:
  baseline  a per-tensor broadcast (cast, full_tensor, one blocking broadcast per tensor);
            with CUDA IPC (learner and engine on one GPU, where NCCL cannot run) it is a
            per-tensor gloo broadcast of the CUDA tensors
  bound     one copy of the same bytes into the first engine's memory: memcpy on CPU,
            device-to-device on one GPU, GPU to GPU where the engines hold other GPUs
A publish is timed on the learner, from the call to every engine's WeightDone and the
learner's device drained (the engine's copies out of the last bucket are queued on its
device, not awaited, when it answers); `config.publish_phases_s` splits it as the publisher
does (group, meta, buckets, done).
Prints a table, then one JSON object per figure; `ratio` > 1 means better than the
baseline, `fraction_of_bound` <= 1 is how close to the copy bound the publish gets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import git_sha
from bench.shapes import SHAPES
from pipeline.models import CausalLM, ModelConfig
from pipeline.transport.channel import free_tcp_port

ROLLOUT = torch.bfloat16
BASELINE_GENERATION = 1_000_000  # the bench-only gloo group, far from real generations


def param_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in named_parameters order, from a meta-device model (no memory)."""
    with torch.device("meta"):
        model = CausalLM(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _devices(args: argparse.Namespace) -> tuple[list[torch.device], list[torch.device], str]:
    """Learner and engine devices and the transport: NCCL across GPUs, CUDA IPC on one."""
    n, m = args.learners, args.engines
    if args.device == "cpu":
        return [torch.device("cpu")] * n, [torch.device("cpu")] * m, "gloo"
    count = torch.cuda.device_count()
    if count >= n + m:
        return (
            [torch.device("cuda", i) for i in range(n)],
            [torch.device("cuda", n + i) for i in range(m)],
            "nccl",
        )
    if n == 1:
        return [torch.device("cuda", 0)], [torch.device("cuda", 0)] * m, "cuda_ipc"
    raise SystemExit(f"{n} learners + {m} engines need {n + m} GPUs (have {count})")


def _copy_kind(src: torch.device, dst: torch.device) -> str:
    """What the bound's copy from `src` into `dst` is."""
    if src.type == "cpu":
        return "memcpy"
    if src != dst:
        return f"GPU-to-GPU copy ({src} to {dst})"
    return "device-to-device copy"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _baseline_group(store: Any, rank: int, members: list[str], device: torch.device) -> Any:
    from pipeline.weights.group import WeightGroup
    from pipeline.wire.weights import GroupAssign

    spec = GroupAssign(
        generation=BASELINE_GENERATION,
        rank=rank,
        world=len(members),
        senders=1,
        members=members,
        backend="gloo",
        store_host="",
        store_port=0,
        timeout_s=600,
        rendezvous_s=120,
    )
    return WeightGroup.build(store, spec, device=device)


def _timeouts() -> Any:
    from pipeline.weights import SyncTimeouts
    from pipeline.weights import config as deadlines

    # generous deadlines for large models; the group's and the metadata's are constants
    deadlines.GROUP_TIMEOUT_S = deadlines.META_TIMEOUT_S = 120.0
    return SyncTimeouts(bucket_timeout_s=600, apply_timeout_s=600)


def _learner(rank: int, args: argparse.Namespace, endpoint: str, port: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from pipeline.weights import PublishConfig, WeightHub, WeightPublisher

    learner_devices, engine_devices, transport = _devices(args)
    device = learner_devices[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n = args.learners
    mesh = None
    if n > 1:
        from torch.distributed.device_mesh import init_device_mesh

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n
        )
        mesh = init_device_mesh(device.type, (n,))
    params: dict[str, torch.Tensor] = {}
    gen = torch.Generator(device=device).manual_seed(rank)
    for name, shape in param_shapes(SHAPES[args.shape]):
        if mesh is None:
            params[name] = torch.randn(shape, generator=gen, device=device)
            continue
        rows = -(-shape[0] // n)
        mine = max(0, min(rows, shape[0] - rank * rows))
        local = torch.randn((mine, *shape[1:]), generator=gen, device=device)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        params[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    hub = WeightHub(endpoint=endpoint) if rank == 0 else None
    if hub is not None and len(hub.wait_for_members(args.engines, 300)) < args.engines:
        raise SystemExit("engines did not register")
    config = PublishConfig(
        bucket_mb=args.bucket_mb,
        striped=args.striped,
        transport=transport if transport == "cuda_ipc" else "auto",
        timeouts=_timeouts(),
    )
    publisher = WeightPublisher(params, hub=hub, config=config)
    seconds, phases = [], []
    for version in range(1, args.repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        report = publisher.publish(version)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        phases.append(report.phases)
    group = publisher.group
    if group is None and publisher.participates:  # CUDA IPC: a bench-only gloo group
        assert hub is not None
        group = _baseline_group(hub.store.store, 0, ["learner-0", *hub.names()], device)
    base = []
    for _ in range(args.repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        for p in params.values():
            full = p.detach().to(ROLLOUT)  # the naive path: cast, gather, send, per tensor
            if isinstance(full, DTensor):
                full = full.full_tensor()
            if group is not None:
                group.broadcast(_bytes(full), 0).wait()
        _sync(device)
        base.append(time.perf_counter() - t0)
    if rank == 0:
        total = publisher.plan.total_bytes
        # at least 256 MiB so that the copy measures memory, not cache, bandwidth
        size = max(total, 256 << 20)
        src = torch.ones(size, dtype=torch.uint8, device=device)
        # into the first engine's memory: GPU to GPU (NVLink) where they hold another GPU
        dst = torch.empty(size, dtype=torch.uint8, device=engine_devices[0])
        dst.copy_(src)
        copies = []
        for _ in range(max(3, args.repeats)):
            _sync(device)
            _sync(dst.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            _sync(dst.device)
            copies.append((time.perf_counter() - t0) * total / size)
        del src, dst
        queue.put(
            {
                "bytes": total,
                "buckets": publisher.plan.num_buckets,
                "transport": publisher.transport,
                "publish_s": statistics.median(seconds[1:]),
                "first_s": seconds[0],
                "max_after_first_s": max(seconds[1:]),
                "publish_runs_s": seconds,
                # the publisher's own phase split, median over the publishes after the first
                "phases_s": {
                    k: round(statistics.median(p[k] for p in phases[1:]), 6) for k in phases[0]
                },
                "baseline_s": statistics.median(base[1:]),
                "bound_s": statistics.median(copies),
                "bound_kind": _copy_kind(device, engine_devices[0]),
                "tensors": len(params),
            }
        )
    if group is not None and group is not publisher.group:
        group.close()
    publisher.close()
    if hub is not None:
        hub.close()
    if n > 1:
        dist.destroy_process_group()


def _tp_place(index: int, args: argparse.Namespace) -> tuple[int, int]:
    """With --tp T: engine 0 holds the whole model (the baseline), engines 1..T are the
    ranks of one TP replica."""
    if args.tp <= 1 or index == 0:
        return 0, 1
    return index - 1, args.tp


def _engine(index: int, args: argparse.Namespace, endpoint: str, queue: Any) -> None:
    from pipeline.weights import WeightReceiver
    from pipeline.weights.group import store_client
    from pipeline.weights.reshard import shard_shape
    from pipeline.weights.validate import ParamSpec

    _, engine_devices, _ = _devices(args)
    device = engine_devices[index]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp_rank, tp_size = _tp_place(index, args)
    shapes = param_shapes(SHAPES[args.shape])
    specs = {n: ParamSpec(shard_shape(n, s, tp_rank, tp_size), ROLLOUT) for n, s in shapes}
    receiver = WeightReceiver(
        f"engine-{index}",
        endpoint,
        specs,
        lambda tensors, version: None,  # the staging tensors are the landed update
        replica=index,
        tp_rank=tp_rank,
        tp_size=tp_size,
        device=device,
        timeouts=_timeouts(),
    )
    receiver.register()
    last = args.repeats + 1
    if not receiver.run_until(lambda: receiver.version == last, 3600):
        raise SystemExit(f"engine-{index}: publishes did not complete")
    queue.put({"engine": index, "tp_size": tp_size, "bytes": receiver.received_bytes})
    group = receiver.group
    if group is None:  # CUDA IPC: the baseline runs on a bench-only gloo group
        assert receiver.assign is not None
        a = receiver.assign
        store = store_client(a.store_host, a.store_port, 120)
        members = ["learner-0", *[f"engine-{i}" for i in range(args.engines)]]
        group = _baseline_group(store, 1 + index, members, device)
    full = [torch.empty(s, dtype=ROLLOUT, device=device) for _, s in shapes]
    for _ in range(args.repeats + 1):  # the naive path sends everyone full tensors
        for t in full:
            group.broadcast(_bytes(t), 0).wait()
        _sync(device)
    if group is not receiver.group:
        group.close()
    receiver.close()


def figures(result: dict[str, Any], args: argparse.Namespace, device: str) -> list[dict]:
    gb = result["bytes"] / 1e9
    config = {
        "shape": args.shape,
        "learners": args.learners,
        "engines": args.engines,
        "bucket_mb": args.bucket_mb,
        "striped": args.striped,
        "repeats": args.repeats,
        "transport": result["transport"],
        "bytes": result["bytes"],
        "buckets": result["buckets"],
        "tensors": result["tensors"],
        "dtype": "bfloat16",
        "baseline_kind": "per-tensor broadcast",
        "publish_runs_s": [round(x, 6) for x in result.get("publish_runs_s", [])],
        "bound_kind": result["bound_kind"],
        "publish_phases_s": result.get("phases_s", {}),
        "tp": args.tp,
    }
    common = {
        "bench": "weight_sync",
        "baseline": "per_tensor_broadcast",
        "device": device,
        "config": config,
        "git": git_sha(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    pub, base, bound = result["publish_s"], result["baseline_s"], result["bound_s"]
    out = []
    if args.tp > 1:  # resharded buckets: what a TP rank receives against a whole engine
        got = {r["engine"]: r for r in result["received"]}
        whole = got[0]["bytes"]
        rank = max(r["bytes"] for r in result["received"] if r["tp_size"] > 1)
        out.append(
            common
            | {
                "figure": "bytes_per_engine_rank",
                "value": float(rank),
                "baseline": "whole_model_engine",
                "baseline_value": float(whole),
                "ratio": round(rank / whole, 4),
                "bound": round(whole / args.tp, 1),  # an even split of every tensor
                "fraction_of_bound": round(whole / args.tp / rank, 4),
            }
        )
    return [
        *out,
        {
            "figure": "publish_seconds",
            "value": round(pub, 6),
            "baseline_value": round(base, 6),
            "ratio": round(base / pub, 4),  # speed-up over the baseline
            "bound": round(bound, 6),
            "fraction_of_bound": round(bound / pub, 4),
        }
        | common,
        {
            "figure": "first_sync_seconds",
            "value": round(result["first_s"], 6),
            "baseline_value": round(base, 6),
            "ratio": round(base / result["first_s"], 4),
            "bound": round(bound, 6),
            "fraction_of_bound": round(bound / result["first_s"], 4),
        }
        | common,
        {
            "figure": "max_sync_seconds_after_first",
            "value": round(result["max_after_first_s"], 6),
            "baseline_value": round(base, 6),
            "ratio": round(base / result["max_after_first_s"], 4),
            "bound": round(bound, 6),
            "fraction_of_bound": round(bound / result["max_after_first_s"], 4),
        }
        | common,
        {
            "figure": "publish_gbps",
            "value": round(gb / pub, 4),
            "baseline_value": round(gb / base, 4),
            "ratio": round(base / pub, 4),
            "bound": round(gb / bound, 4),
            "fraction_of_bound": round(bound / pub, 4),
        }
        | common,
    ]


def _order(fig: dict) -> dict:
    keys = ["bench", "figure", "value", "baseline", "baseline_value", "ratio", "bound"]
    keys += ["fraction_of_bound", "device", "config", "git", "date"]
    return {k: fig[k] for k in keys}


def run(args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    _devices(args)  # refuse impossible layouts before starting anything
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    received = ctx.Queue()
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    port = free_tcp_port()
    procs = [
        ctx.Process(target=_learner, args=(r, args, endpoint, port, queue), daemon=True)
        for r in range(args.learners)
    ] + [
        ctx.Process(target=_engine, args=(i, args, endpoint, received), daemon=True)
        for i in range(args.engines)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + args.timeout
        result = None
        while result is None:
            try:
                result = queue.get(timeout=1.0)
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise SystemExit(
                        f"bench failed: exit codes {[p.exitcode for p in procs]}"
                    ) from None
        for p in procs:
            p.join(timeout=60)
        result["received"] = [received.get(timeout=10) for _ in range(args.engines)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0)
    return [_order(f) for f in figures(result, args, device)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.weight_sync")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--learners", type=int, default=1)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--striped", action="store_true")
    ap.add_argument(
        "--tp", type=int, default=1, help="engines 1..T: one TP replica (engine 0 whole)"
    )
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    if args.shape is None:
        args.shape = "tiny" if args.device == "cpu" else "7b"
    if args.tp > 1:
        args.engines = args.tp + 1
    if args.bucket_mb is None:
        args.bucket_mb = 2.0 if args.shape == "tiny" else 1024.0
    os.environ.setdefault("PIPELINE_LOG_LEVEL", "warning")
    figs = run(args)
    c = figs[0]["config"]
    print(
        f"weight_sync  shape={args.shape} device={figs[0]['device']} transport={c['transport']} "
        f"learners={args.learners} engines={args.engines} bucket={args.bucket_mb}MB "
        f"({c['buckets']} buckets, {c['bytes'] / 1e9:.3f} GB bf16, {c['tensors']} tensors)"
    )
    print(f"{'figure':<18}{'value':>12}{'baseline':>12}{'ratio':>8}{'bound':>12}{'of bound':>10}")
    for f in figs:
        print(
            f"{f['figure']:<18}{f['value']:>12.4f}{f['baseline_value']:>12.4f}"
            f"{f['ratio']:>8.2f}{f['bound']:>12.4f}{f['fraction_of_bound']:>10.3f}"
        )
    for f in figs:
        print(json.dumps(f))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figs, indent=1) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
