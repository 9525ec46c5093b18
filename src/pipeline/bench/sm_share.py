"""SM-share check: the learner's log-probs with a share of the SMs against the whole GPU.

    python -m pipeline.bench.sm_share [--shares 80,70] [--variant k=v,...]... [--json OUT]

Why: on one GPU at staleness 1, runs that capped the learner at 80 % or 70 % of the SMs
(`services.learner.gpu_share`, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) were faster, but the
learner's log-probs were wrong from step 0 (mismatch KL NaN at 80 %, 0.085 at 70 %; 90 %
was bitwise right; docs/performance.md). This bench narrows down which of the learner's
knobs is wrong on fewer SMs, without a whole run.

A private MPS daemon is started (as a run's supervisor does). For each variant of the
profile's `[learner.trainer]` knobs (the profile's own first, then each `--variant`, as in
the learner_step bench) and each share, a child process with that share builds the learner
on a random model of `--shape`, warms it up as a service does (every update skipped: the
trunk graphs are captured then), and computes the response log-probs of one fixed batch
twice (`PolicyTrainer.compute_logprobs`, the proximal forward). Each result is compared with
the same variant's at 100 %: one JSON line per variant and share with the largest absolute
difference, the NaN count, the difference between the child's own two computations, and
the largest difference from the profile's own knobs at 100 % (`vs_profile_max_abs_diff`),
and what the services' start-up check of the layers' matrix products says at that share
(`products`: "ok" or the refusal, sm_share_check.py).
On CPU (no MPS) every variant runs once without a share: the plumbing only.

`--trace` checksums every op of the two computations (`op_trace.py`) and reports the first
op where they part and the first non-finite one: with `--variant
compile=false,trunk_graphs=false` that names the kernel a race hits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.common import device_defaults, git_sha, now_iso
from pipeline.bench.learner_step import parse_variant, profile_knobs, synthetic_batch
from pipeline.bench.rollout_decode import bench_dtype, device_label, save_random_model

BENCH = "sm_share"
REPO = Path(__file__).resolve().parents[3]
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"shape": "0.5b", "batch": 64, "seq": 318, "prompt": 62},
    "cpu": {"shape": "tiny", "batch": 4, "seq": 48, "prompt": 16},
}


def child(args: argparse.Namespace) -> None:
    """Build the learner, warm it up, write its log-probs of the batch (twice) to args.out."""
    from pipeline.algorithms import AlgorithmConfig
    from pipeline.training import PolicyTrainer, TrainerConfig

    cuda = args.device == "cuda"
    fields: dict[str, Any] = {
        **profile_knobs(args.profile),
        "lr": 1e-6,
        "device": args.device,
        "param_dtype": "bfloat16" if cuda else "float32",
        **parse_variant(args.set),
    }
    trainer = PolicyTrainer(
        args.model, TrainerConfig(**fields), AlgorithmConfig(advantage_estimator="grpo")
    )
    vocab = trainer.model.config.vocab_size
    batch, _ = synthetic_batch(args.batch, args.seq, args.prompt, vocab, args.seed)
    trainer.warm_up([batch])
    label = device_label(torch.device(args.device))
    products = _products(trainer)
    if not args.trace:
        first = trainer.compute_logprobs(batch).float().cpu()
        again = trainer.compute_logprobs(batch).float().cpu()
        saved = {"first": first, "again": again, "device": label, "products": products}
        torch.save(saved, args.out)
        return
    from pipeline.bench.op_trace import OpChecksums, first_divergence

    with OpChecksums() as traced:
        first = trainer.compute_logprobs(batch).float().cpu()
    with OpChecksums() as traced_again:
        again = trainer.compute_logprobs(batch).float().cpu()
    trace = first_divergence(traced, traced_again)
    saved = {"first": first, "again": again, "device": label, "trace": trace}
    torch.save({**saved, "products": products}, args.out)


def _products(trainer: Any) -> str:
    """The start-up check of the layers' matrix products at this process's share: "ok" or
    why a service would refuse it."""
    from pipeline.sm_share_check import SmShareRefused, check_part_products, sm_share

    try:
        check_part_products("learner", sm_share() or 100, [trainer])
    except SmShareRefused as refused:
        return str(refused)
    return "ok"


def compare(result: dict[str, Any], base: torch.Tensor) -> dict[str, Any]:
    """The largest and mean |difference| against `base` over the values finite in both
    (None where none is), the non-finite values, the gap between the child's two results."""
    first, again = result["first"], result["again"]
    both = torch.isfinite(first) & torch.isfinite(base)
    diff = (first - base).abs()[both]
    repeat = (first - again).abs().nan_to_num(float("inf"))
    return {
        "max_abs_diff": float(diff.max()) if diff.numel() else None,
        "mean_abs_diff": float(diff.mean()) if diff.numel() else None,
        "non_finite": int((~torch.isfinite(first)).sum()),
        "repeat_max_abs_diff": float(repeat.max()) if repeat.numel() else 0.0,
    }


def run_child(
    args: argparse.Namespace, model: Path, out: Path, variant: str, env: dict[str, str]
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pipeline.bench.sm_share", "--child", "--device", args.device]
    cmd += ["--model", str(model), "--out", str(out), "--set", variant]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--prompt", str(args.prompt)]
    cmd += ["--seed", str(args.seed)] + (["--trace"] if args.trace else [])
    if args.profile is not None:
        cmd += ["--profile", str(args.profile)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child {variant or '(profile)'} failed:\n{proc.stderr[-3000:]}")
    return torch.load(out)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pipeline.runtime.gpu_sharing import MPS_CONTROL, GpuSharing, MpsDaemon

    cuda = args.device == "cuda"
    shares = sorted({100, *args.shares}, reverse=True) if cuda else [100]
    if cuda and shutil.which(MPS_CONTROL) is None:
        raise SystemExit(f"{MPS_CONTROL} is not on PATH: the shares need CUDA MPS")
    rows: list[dict[str, Any]] = []
    device = torch.device(args.device)
    # the daemon a run's supervisor starts, with the learner's share set per child
    sharing = GpuSharing("mps", "the sm_share bench")
    daemon = MpsDaemon(sharing, dict(os.environ))
    with tempfile.TemporaryDirectory(prefix="sm-share-") as tmp:
        root = Path(tmp)
        # made on the CPU: this process keeps off the GPU, whose clients are the children
        dtype = bench_dtype(device)
        save_random_model(args.shape, root / "model", dtype=dtype, device=torch.device("cpu"))
        if cuda:
            daemon.start(required=True)
        try:
            profile: torch.Tensor | None = None
            for v, variant in enumerate(["", *args.variant]):
                results: dict[int, dict[str, Any]] = {}
                for share in shares:
                    env = dict(os.environ)
                    if cuda:
                        sharing.shares["learner"] = share
                        sharing.apply(env, "learner")
                    out = root / f"v{v}-s{share}.pt"
                    results[share] = run_child(args, root / "model", out, variant, env)
                    if profile is None:
                        profile = results[share]["first"]
                    row = {
                        "bench": BENCH,
                        "variant": variant or "(profile)",
                        "share": share,
                        **compare(results[share], results[100]["first"]),
                        "vs_profile_max_abs_diff": compare(results[share], profile)["max_abs_diff"],
                        "products": results[share]["products"],
                        "device": results[share]["device"],
                        **({"trace": results[share]["trace"]} if args.trace else {}),
                        "config": {k: getattr(args, k) for k in ("shape", "batch", "seq")},
                        "git": git_sha(),
                        "date": now_iso(),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            daemon.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences in the batch")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens of each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=Path, default=None, help="its [learner.trainer] knobs")
    ap.add_argument(
        "--shares",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[80, 70],
        help="SM percentages besides 100 (always run)",
    )
    ap.add_argument(
        "--variant", action="append", default=[], help="k=v,... on top of the profile's"
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="checksum every op of the two computations; report where they part (op_trace.py)",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--set", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if any(not 1 <= share <= 100 for share in args.shares):
        ap.error(f"--shares are percentages of the SMs, 1 to 100: got {args.shares}")
    device_defaults(args, DEFAULTS)
    if args.profile is None and args.device == "cuda":
        args.profile = REPO / "profiles" / "h200-single.toml"
    if args.child:
        child(args)
        return
    rows = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
