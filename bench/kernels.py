"""The learner step's memory-bound kernels at its shapes: GB/s of our Triton kernels against
the same formula in torch, with the device's copy bandwidth as the bound.

    python -m bench.kernels [--device cuda] [--shape 0.5b] [--tokens 8192]
                                     [--logit-rows 4096] [--json OUT]

Each case is one op of a training step on `--tokens` tokens (`--logit-rows` rows of the
output layer's logits): the fused residual add + RMSNorm forward and backward
(models/norm_kernel.py), SwiGLU over the packed gate|up output (swiglu_kernel.py), RoPE over
the q/k/v projection output (rope_kernel.py), the log-prob statistics and the logits'
gradient (logit_stats.py). Measured per call:
  ours      the op as the trainer calls it (its Triton kernel where Triton runs; elsewhere
            its torch formula, and the figure then compares the formula with itself)
  baseline  the op's torch formula (the trainer's fallback), under `torch.compile` on CUDA
            (inductor's fused kernels: what the compiled trunk would run without ours),
            eager on CPU
  bound     the device's copy bandwidth measured in the same run (rollout_decode's: bytes
            read + written by copies of 1 GiB on CUDA, 64 MiB on CPU)
GB/s = the bytes the op must move at least (its inputs read once, outputs written once) /
seconds. On CUDA each timing replays `--reps` calls captured in one CUDA graph, so the host's
launch cost is not in it (a plain launch loop measured ~68 us a call for ~22 us kernels);
the median of `--repeats` replays. The step's time in each op is in the learner bench's
`--torch-profile` trace; this bench says how far each kernel is from the bandwidth and from
what inductor makes of the formula.
Prints a table, then one JSON object per figure (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bench.common import device_defaults, emit, figure, table
from bench.rollout_decode import bench_dtype, copy_bandwidth, device_label
from bench.shapes import SHAPES
from pipeline.models import logprobs, norm_kernel, rope_kernel, swiglu_kernel

BENCH = "kernels"
DEFAULTS = {
    "cuda": {"shape": "0.5b", "tokens": 8192, "logit_rows": 4096, "reps": 20, "repeats": 10},
    "cpu": {"shape": "tiny", "tokens": 256, "logit_rows": 64, "reps": 3, "repeats": 3},
}


@dataclass
class Case:
    """One op: ours and its formula on the same inputs, and the bytes it moves."""

    name: str
    bytes: int
    ours: Callable[[], Any]
    formula: Callable[[], Any]


def cases(config: Any, tokens: int, logit_rows: int, device: torch.device) -> list[Case]:
    """The ops at a model config's shapes, inputs drawn once (bf16 on CUDA, float32 on CPU)."""
    dtype = bench_dtype(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    width, vocab, item = (heads + 2 * kv) * hd, config.vocab_size, dtype.itemsize
    eps = config.rms_norm_eps

    x, delta, dy, ds_in = (randn(tokens, h) for _ in range(4))
    w = 1 + 0.1 * randn(h)
    s, _, rstd = norm_kernel._add_rms_norm(x, delta, w, eps)
    gu, dh = randn(tokens, 2 * inter), randn(tokens, inter)
    qkv = randn(tokens, width)
    angles = torch.rand(tokens, hd // 2, device=device, generator=gen) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    dq, dk, dv = randn(tokens, heads, hd), randn(tokens, kv, hd), randn(tokens, kv, hd)
    logits = randn(logit_rows, vocab) * 3
    targets = torch.randint(0, vocab, (logit_rows,), device=device, generator=gen)
    # the passes as the trainer runs them: Triton where it runs, else the torch formula
    passes = logprobs._Kernels()
    stats, grad = passes.get("stats", device), passes.get("grad", device)
    _, lse, entropy = stats(logits, targets, 1.0, True)
    g_logp = torch.randn(logit_rows, device=device, generator=gen)
    g_ent = torch.zeros_like(g_logp)
    rows = tokens * h * item
    return [
        Case(
            "norm_forward",  # x, delta read; s, y written; rstd
            4 * rows + 4 * tokens,
            lambda: norm_kernel._add_rms_norm(x, delta, w, eps),
            lambda: norm_kernel._torch_forward(x, delta, w, eps),
        ),
        Case(
            "norm_backward",  # dy, residual gradient, s read; ds written; rstd
            4 * rows + 4 * tokens,
            lambda: norm_kernel._add_rms_norm_backward(dy, ds_in, s, rstd, w),
            lambda: norm_kernel._torch_backward(dy, ds_in, s, rstd, w),
        ),
        Case(
            "swiglu_forward",  # gate|up read, h written
            3 * tokens * inter * item,
            lambda: swiglu_kernel._swiglu_packed(gu),
            lambda: swiglu_kernel._torch_forward(gu),
        ),
        Case(
            "swiglu_backward",  # dh, gate|up read; d(gate|up) written
            5 * tokens * inter * item,
            lambda: swiglu_kernel._swiglu_packed_backward(dh, gu),
            lambda: swiglu_kernel._torch_backward(dh, gu),
        ),
        Case(
            "rope_forward",  # qkv read; q, k, v written; cos, sin read
            2 * tokens * width * item + 2 * tokens * hd * item,
            lambda: rope_kernel._rope_qkv(qkv, cos, sin, heads, kv),
            lambda: rope_kernel._torch_forward(qkv, cos, sin, heads, kv),
        ),
        Case(
            "rope_backward",  # dq, dk, dv read; d qkv written; cos, sin read
            2 * tokens * width * item + 2 * tokens * hd * item,
            lambda: rope_kernel._rope_qkv_backward(dq, dk, dv, cos, sin),
            lambda: rope_kernel._torch_backward(dq, dk, dv, cos, sin),
        ),
        Case(
            "logit_stats",  # the logits read once
            logit_rows * vocab * item,
            lambda: stats(logits, targets, 1.0, True),
            lambda: logprobs._logit_stats(logits, targets, 1.0, True),
        ),
        Case(
            "logit_grad",  # the logits read, their gradient written
            2 * logit_rows * vocab * item,
            lambda: grad(logits, targets, lse, g_logp, g_ent, entropy, 1.0),
            lambda: logprobs._logit_grad(logits, targets, lse, g_logp, g_ent, entropy, 1.0),
        ),
    ]


def seconds_per_call(
    fn: Callable[[], Any], device: torch.device, reps: int, repeats: int, warmup: int = 3
) -> float:
    """Median seconds of one call after `warmup` calls: on CUDA `reps` calls in one CUDA
    graph, replayed `repeats` times; on CPU wall time of `reps` calls, `repeats` times."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - start) / reps)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    config = SHAPES[args.shape]
    bound = copy_bandwidth(device) / 1e9
    baseline = "torch_compile" if device.type == "cuda" else "torch_eager"
    figures = []
    for case in cases(config, args.tokens, args.logit_rows, device):
        formula = torch.compile(case.formula) if device.type == "cuda" else case.formula
        ours = seconds_per_call(case.ours, device, args.reps, args.repeats, args.warmup)
        theirs = seconds_per_call(formula, device, args.reps, args.repeats, args.warmup)
        cfg = {
            "shape": args.shape,
            "tokens": args.tokens,
            "logit_rows": args.logit_rows,
            "bytes": case.bytes,
            "us": {"ours": round(ours * 1e6, 2), baseline: round(theirs * 1e6, 2)},
            "timing": f"median of {args.repeats} replays of {args.reps} calls "
            + ("in one CUDA graph" if device.type == "cuda" else "(wall time)"),
            "bound": "copy bandwidth (read + written) measured in this run",
            "dtype": str(bench_dtype(device)).removeprefix("torch."),
            "torch": torch.__version__,
        }
        figures.append(
            figure(
                BENCH,
                f"{case.name}_gb_per_s",
                case.bytes / ours / 1e9,
                baseline=f"{baseline}_{case.name}",
                baseline_value=case.bytes / theirs / 1e9,
                bound=bound,
                config=cfg,
                device=device_label(device),
            )
        )
    return figures


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--tokens", type=int, default=None, help="rows of the trunk's ops")
    ap.add_argument("--logit-rows", type=int, default=None, help="rows of the logits")
    ap.add_argument("--reps", type=int, default=None, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=None, help="timings (median)")
    ap.add_argument("--warmup", type=int, default=3, help="calls of each op before timing")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    device_defaults(args, DEFAULTS)
    if min(args.tokens, args.logit_rows, args.reps, args.repeats) < 1 or args.warmup < 0:
        raise SystemExit("--tokens, --logit-rows, --reps, --repeats >= 1 and --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = run(args)
    print(table(figures))
    emit(figures, args.json)


if __name__ == "__main__":
    main()
