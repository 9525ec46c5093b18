"""A test learner rank: tiny native model under FSDP2 (gloo), publishing several versions
with the default bucket, a bucket smaller than the largest tensor, and
striped senders; rank 0 saves each version's full tensors cast to the rollout dtype."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.weights

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipeline.models import CausalLM, parallelize
from pipeline.weights import PublishConfig, SyncTimeouts, WeightHub, WeightPublisher
from tests.weights.wsync_common import ROLLOUT_DTYPE, SMALL_BUCKET_MB, TINY


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--engines", type=int, required=True)  # weight-group members to wait for
    ap.add_argument("--out", required=True)
    ap.add_argument("--versions", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
    )
    torch.manual_seed(0)
    model = CausalLM(TINY)
    model.init_weights(std=0.2)
    parallelize(model, init_device_mesh("cpu", (args.world,)), param_dtype=torch.float32)
    hub = WeightHub(endpoint=args.endpoint) if args.rank == 0 else None
    if hub is not None:
        hub.wait_for_members(args.engines, 60)
    timeouts = SyncTimeouts(bucket_timeout_s=20, apply_timeout_s=20)
    configs = {
        "default": PublishConfig(timeouts=timeouts),
        "small": PublishConfig(bucket_mb=SMALL_BUCKET_MB, timeouts=timeouts),
        "striped": PublishConfig(bucket_mb=SMALL_BUCKET_MB, striped=True, timeouts=timeouts),
    }
    gen = torch.Generator().manual_seed(1 + args.rank)
    version = 0
    for label, config in configs.items():
        publisher = WeightPublisher(model, hub=hub, config=config)
        for _ in range(args.versions):
            with torch.no_grad():  # new weights: every rank changes its own shards
                for p in model.parameters():
                    local = p.to_local()
                    local.add_(torch.randn(local.shape, generator=gen) * 0.1)
            version += 1
            report = publisher.publish(version)
            full = {n: p.full_tensor().to(ROLLOUT_DTYPE) for n, p in model.named_parameters()}
            if args.rank == 0:
                torch.save(full, Path(args.out) / f"learner.v{version}.pt")
            line = {"event": "published", "config": label, "version": version}
            line |= {"buckets": report.buckets, "engines": report.engines}
            group = publisher.group  # this rank's weight-group membership, if any
            line |= {"group_world": group.spec.world if group else 0}
            # how each tensor is sourced: fsdp (bucketed all_gather), plain, replicated or
            # full_tensor (per-tensor fallback)
            line |= {"sources": sorted(set(publisher.gatherer._kind.values()))}
            line |= {"resharded": bool(publisher.layouts), "bytes": report.bytes}
            print(json.dumps(line), flush=True)
        publisher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
