"""One trainer's warm-up, as its service runs it, in a fresh process: with an empty compile
cache, then with the cache that run filled; seconds per part (model build, each warm-up
batch) and where the compile time went (dynamo's phases, the caches' hits).

    python -m bench.warm_up [--profile profiles/h200-single.toml] [--part learner]
        [--caches cold,warm] [--shape 0.5b] [--cprofile N] [--json OUT] [--section.key V ...]

`--part learner` is the policy trainer (with its reference when the run hosts it there),
`critic` the value trainer. `--cprofile N` profiles the warm run and keeps its N most
expensive functions (cumulative), to see what a cached start still spends. The baseline of
a warm figure is the cold one of the same run (docs/performance.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, emit_file, figure


def child(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Build the part and warm it up in this process; the timings."""
    started = time.perf_counter()
    import torch

    from pipeline.config.profile import load_config, parse_override_args
    from pipeline.training.config import critic_config, policy_config
    from pipeline.training.warm_up import compile_counts, compile_report, warm_up_batches

    out: dict[str, Any] = {"import_s": round(time.perf_counter() - started, 3)}
    config = load_config(args.profile, parse_override_args(extra))
    t = time.perf_counter()
    if args.part == "learner":
        from pipeline.training import PolicyTrainer

        part = PolicyTrainer(args.model_dir, policy_config(config), config.algorithm)
    else:
        from pipeline.training.critic_trainer import CriticTrainer

        part = CriticTrainer(args.model_dir, critic_config(config), config.algorithm)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    out["build_s"] = round(time.perf_counter() - t, 3)
    batches = warm_up_batches(config, part.model.config.vocab_size)
    for i, batch in enumerate(batches):
        t = time.perf_counter()
        part.warm_up([batch])
        out[f"batch{i}_s"] = round(time.perf_counter() - t, 3)
    out["total_s"] = round(time.perf_counter() - started, 3)
    out.update(compile_counts())
    out.update(compile_report())
    out["cpu_kernels"] = cpu_kernels(
        Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/nonexistent"))
    )
    return out


def cpu_kernels(cache: Path) -> list[str]:
    """The C++ (CPU) kernels in the compiled graphs, by the ATen ops they came from: on a
    GPU run each one costs a C++ build and inductor's CPU-ISA probes at start."""
    found: set[str] = set()
    for path in cache.rglob("*.py"):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "cpp_pybinding(" not in line and "CppPythonBindings" not in line:
                continue
            notes = [x.strip() for x in lines[max(0, i - 12) : i] if x.lstrip().startswith("#")]
            found.add(f"{path.name}: {line.strip()[:80]} | {' '.join(notes)[-600:]}")
    return sorted(found)


def run_child(argv: list[str], cache: Path, profile_top: int, gpu: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    if gpu:  # as a GPU service runs it (runtime/cli_args.compile_caches)
        env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    cmd = [sys.executable, "-m", "bench.warm_up", "--child", *argv]
    if profile_top:
        cmd += ["--cprofile", str(profile_top)]
    launched = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"warm-up child failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - launched, 3)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", default="profiles/h200-single.toml")
    ap.add_argument("--part", choices=("learner", "critic"), default="learner")
    ap.add_argument("--caches", default="cold,warm")
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    if args.child:
        if not args.cprofile:
            print(json.dumps(child(args, extra)))
            return
        profiler = cProfile.Profile()
        result = profiler.runcall(child, args, extra)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        for order in ("cumulative", "tottime"):
            stats.sort_stats(order).print_stats(args.cprofile)
            result[f"cprofile_{order}"] = text.getvalue().splitlines()[-args.cprofile - 1 : -1]
        print(json.dumps(result))
        return
    from bench.e2e import device_label, shape_model

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="warm-up-") as tmp:
        model_args = shape_model(args.shape, Path(tmp) / "model", args.device)
        overrides = [*extra, *model_args]
        passed = ["--profile", args.profile, "--part", args.part, *overrides]
        passed += ["--model-dir", str(Path(tmp) / "model")]
        cache = Path(tmp) / "cache"
        for kind in args.caches.split(","):
            top = args.cprofile if kind == "warm" else 0
            results[kind] = run_child(passed, cache, top, args.device != "cpu")
            print(f"=== {kind}: total {results[kind]['total_s']} s", file=sys.stderr, flush=True)
    figs = []
    for kind, r in results.items():
        other = results.get("warm" if kind == "cold" else "cold", {})
        figs.append(
            figure(
                "warm_up",
                f"{args.part}_warm_up_s_{kind}",
                r["total_s"],
                baseline=f"{'warm' if kind == 'cold' else 'cold'}_cache",
                baseline_value=other.get("total_s", float("nan")),
                bound=r["build_s"],
                lower_is_better=True,
                config={"profile": args.profile, "shape": args.shape, "overrides": extra, **r},
                device=device_label(args.device),
            )
        )
    if args.json is not None:
        emit_file(figs, args.json)
    emit(figs)


if __name__ == "__main__":
    main()
