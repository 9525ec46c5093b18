"""Cold start: seconds from `pipeline run` to each service's ready, to the first finished
step and to step 10, with a fresh compile cache and then with the cache of that run.

    python -m bench.cold_start [--profile profiles/h200-single.toml]
        [--variants grpo,ppo] [--caches cold,warm] [--steps 12] [--shape 0.5b]
        [--json OUT] [--section.key VALUE ...]

Each (variant, cache) is one real `pipeline run` of `--steps` steps of the profile with a
random model of `--shape` (docs/performance.md): `grpo` without the critic, `ppo` the profile's
KL-PPO with the critic. `cold` starts from an empty `run.compile_cache_dir`, `warm` from
the one the cold run of the same variant filled; the warm figure's baseline is the cold
one. Recompiles after the warm-up are each step's `compile/recompiles` (learner) and
`critic/recompiles`; peak GPU memory is sampled with nvidia-smi twice a second. The JSON
is written after every run, so a bench stopped at its time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import cpu_name, emit, emit_file, figure
from bench.e2e_workload import FIXED_TOKENS, VARIANTS


class MemorySampler:
    """The largest memory.used of every visible GPU while running (MiB, nvidia-smi)."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self._every):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
                used = [float(x) for x in out.split()]
            except (OSError, ValueError, subprocess.TimeoutExpired):
                continue
            self.peak_mib = max(self.peak_mib, sum(used))

    def __enter__(self) -> MemorySampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def measure(run_dir: Path, launched: float) -> dict[str, float]:
    """Seconds after launch: each service's ready, the first and the tenth step."""
    out: dict[str, float] = {}
    for path in sorted((run_dir / "metrics").glob("*-*.jsonl")):
        ready = [r for r in _jsonl(path) if r.get("kind") == "ready"]
        if ready:
            out[f"ready_s.{path.stem}"] = round(ready[0]["end"] - launched, 3)
    steps = _jsonl(run_dir / "metrics" / "steps.jsonl")
    if steps:
        out["first_step_s"] = round(steps[0]["time"] - launched, 3)
    if len(steps) >= 10:
        out["step10_s"] = round(steps[9]["time"] - launched, 3)
    later = steps[1:]
    out["steps"] = float(len(steps))
    out["recompiles_after_step0"] = float(
        max((s.get("compile/recompiles", 0) for s in later), default=0)
        - (steps[0].get("compile/recompiles", 0) if steps else 0)
    )
    for role in ("critic", "reference", "rollout"):
        key = f"{role}/recompiles"
        out[f"{role}_recompiles"] = float(max((s.get(key, 0) for s in steps), default=0))
    lengths = [s.get("response_len_min", 0) for s in steps] + [
        s.get("response_len_max", 0) for s in steps
    ]
    if lengths:  # whether the run met new shapes: lengths that vary
        out["response_len_min"], out["response_len_max"] = min(lengths), max(lengths)
    if len(steps) > 3:
        wall = steps[-1]["time"] - steps[2]["time"]
        samples = sum(s["trained"] for s in steps[3:])
        out["steady_samples_per_s"] = round(samples / wall, 2) if wall > 0 else 0.0
        out["steady_step_s"] = round(wall / (len(steps) - 3), 3)
    return out


def run_once(profile: str, name: str, runs: Path, cache: Path, extra: list[str]) -> Path:
    cmd = [
        sys.executable, "-m", "pipeline.cli", "run", "--no-progress",
        "--profile", profile, "--name", name, "--run.runs_dir", str(runs),
        "--run.compile_cache_dir", str(cache), *extra,
    ]  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    }
    print(f"=== {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return runs / name


def main(argv: list[str] | None = None) -> None:
    from bench.e2e import shape_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", default="profiles/h200-single.toml")
    ap.add_argument("--variants", default="grpo,ppo")
    ap.add_argument("--caches", default="cold,warm")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here")
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="compile caches here (kept; a later call's `--caches warm` reuses them)",
    )
    args, extra = ap.parse_known_args(argv)
    results: dict[tuple[str, str], dict[str, float]] = {}
    figs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        # the e2e workload's response limit: the profile keeps its task's
        base = [*extra, "--controller.steps", str(args.steps)]
        base += ["--rollout.max_new_tokens", str(FIXED_TOKENS)]
        if args.shape:
            base += shape_model(args.shape, Path(tmp) / "model", args.device)
        runs = args.runs_dir or Path(tmp) / "runs"
        for variant in args.variants.split(","):
            # empty: the cold run fills it
            cache = (args.cache_dir or Path(tmp)) / f"cache-{variant}"
            if "cold" in args.caches.split(","):
                shutil.rmtree(cache, ignore_errors=True)
            for kind in args.caches.split(","):
                name = f"cold-start-{variant}-{kind}"
                launched = time.time()
                with MemorySampler() as memory:
                    run_dir = run_once(args.profile, name, runs, cache, [*base, *VARIANTS[variant]])
                result = measure(run_dir, launched)
                result["peak_gpu_mib"] = memory.peak_mib
                results[(variant, kind)] = result
                figs = figures(results, args)
                if args.json is not None:
                    emit_file(figs, args.json)
    emit(figs)


def figures(
    results: dict[tuple[str, str], dict[str, float]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """First finished step after launch per (variant, cache), lower is better: a cold run
    against the warm run of its variant (the same machine, its own cache), a warm run
    against the cold one; the bound is one steady-state step (what a first step would take
    with nothing to load or compile)."""
    from bench.e2e import device_label

    out = []
    for (variant, kind), r in results.items():
        other = results.get((variant, "warm" if kind == "cold" else "cold"), {})
        steady = r.get("steady_step_s", float("nan"))
        out.append(
            figure(
                "cold_start",
                f"first_step_s_{variant}_{kind}",
                r.get("first_step_s", float("nan")),
                baseline=f"{'warm' if kind == 'cold' else 'cold'}_cache",
                baseline_value=other.get("first_step_s", float("nan")),
                bound=steady,
                lower_is_better=True,
                # the host's CPU: a start-up is mostly host work (imports, traces, loads)
                config={
                    "profile": args.profile,
                    "shape": args.shape,
                    "steps": args.steps,
                    "host_cpu": cpu_name(),
                    **r,
                },
                device=device_label(args.device),
            )
        )
    return out


if __name__ == "__main__":
    main()
