"""A test engine process: one WeightReceiver per TP rank (each a weight-group member) and a
safe-point loop that applies updates and saves what it applied, per member and version."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.weights

import torch

from pipeline.engines.weights import SafePoint
from pipeline.weights import SyncTimeouts, WeightReceiver, cuda_ipc
from tests.weights.wsync_common import ROLLOUT_DTYPE, shard_specs


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--slow-version", type=int, default=-1)  # sleep in each bucket of it
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--bucket-s", type=float, default=10.0)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--device", default="cpu")  # cuda: the learner's GPU (CUDA IPC)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    points, loads, receivers = [], [], []
    for rank in range(args.tp_size):
        member = args.name if args.tp_size == 1 else f"{args.name}.tp{rank}"
        specs = shard_specs(rank, args.tp_size)
        device = torch.device(args.device)
        serving = {
            n: torch.zeros(s.shape, dtype=ROLLOUT_DTYPE, device=device) for n, s in specs.items()
        }

        def load(tensors, version, member=member, serving=serving):
            for name, value in tensors.items():
                serving[name].copy_(value)
            torch.save({n: t.cpu() for n, t in serving.items()}, out / f"{member}.v{version}.pt")
            emit(event="applied", member=member, version=version, ipc_opened=len(cuda_ipc._opened))

        def on_bucket(version, bucket, total, member=member):
            emit(event="bucket", member=member, version=version, bucket=bucket, total=total)
            if version == args.slow_version:
                time.sleep(args.slow_s)

        point = SafePoint(version=-1)
        receiver = WeightReceiver(
            member,
            args.endpoint,
            specs,
            point.offer,
            replica=args.replica,
            tp_rank=rank,
            tp_size=args.tp_size,
            device=device,
            timeouts=SyncTimeouts(bucket_timeout_s=args.bucket_s, apply_timeout_s=20),
            on_bucket=on_bucket,
        )
        receiver.start()
        points.append(point)
        loads.append(load)
        receivers.append(receiver)
    emit(event="started", name=args.name)
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:  # the engine loop: apply only between "steps"
        for point, load in zip(points, loads, strict=True):
            point.run(load)
        time.sleep(0.005)
    for receiver in receivers:
        receiver.stop()


if __name__ == "__main__":
    main()
