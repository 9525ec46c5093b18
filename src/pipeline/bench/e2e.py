"""End to end: trained samples/s of async (staleness >= 1) against sync (staleness 0).

    python -m pipeline.bench.e2e [--profile P] [--steps N] [--staleness 0,1,2] [--json OUT]

Each setting is a whole `pipeline run` of the same profile and the same number of steps,
one after the other in this run; sync (staleness 0) is the baseline. The bound is the
slower of generation and training alone, estimated from the sync run's own spans (busy
seconds of the rollout service and of the learner per step). The idle share of each side
is 1 - busy / wall over the steady part of the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.bench.common import emit, figure


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def _busy(spans: list[dict[str, Any]], start: float, end: float) -> float:
    """Seconds inside [start, end] covered by at least one span (overlaps counted once)."""
    intervals = sorted(
        (max(s["start"], start), min(s["end"], end)) for s in spans if s["end"] > start
    )
    busy, cursor = 0.0, start
    for lo, hi in intervals:
        lo = max(lo, cursor)
        if hi > lo:
            busy += hi - lo
            cursor = hi
    return busy


def measure(run_dir: Path, skip: int) -> dict[str, float]:
    steps = _jsonl(run_dir / "metrics" / "steps.jsonl")
    if len(steps) <= skip + 1:
        raise SystemExit(f"{run_dir}: only {len(steps)} steps; raise --steps")
    t0, t1 = steps[skip]["time"], steps[-1]["time"]
    samples = sum(s["trained"] for s in steps[skip + 1 :])
    spans: dict[str, list[dict[str, Any]]] = {"rollout": [], "learner": []}
    for path in (run_dir / "metrics").glob("*-*.jsonl"):
        role = path.stem.split("-")[0]
        if role in spans:
            spans[role].extend(r for r in _jsonl(path) if r.get("kind") == "span")
    wall = t1 - t0
    gen_busy = _busy(spans["rollout"], t0, t1)
    train_busy = _busy([s for s in spans["learner"] if s["name"] == "train"], t0, t1)
    return {
        "samples_per_s": samples / wall,
        "wall_s": wall,
        "samples": samples,
        "gen_idle_share": 1 - gen_busy / wall,
        "train_idle_share": 1 - train_busy / wall,
        "gen_busy_s_per_step": gen_busy / (len(steps) - skip - 1),
        "train_busy_s_per_step": train_busy / (len(steps) - skip - 1),
        "samples_per_step": samples / (len(steps) - skip - 1),
        "mismatch_kl_step0": float(steps[0].get("mismatch/kl", float("nan"))),
    }


def run_one(profile: str, steps: int, staleness: int, runs: Path, extra: list[str]) -> Path:
    name = f"e2e-s{staleness}"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        "--no-progress",
        "--profile",
        profile,
        "--name",
        name,
        "--run.runs_dir",
        str(runs),
        "--controller.steps",
        str(steps),
        "--controller.max_staleness",
        str(staleness),
        *extra,
    ]
    print(f"=== {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return runs / name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", default="profiles/local-cpu.toml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    ap.add_argument("--staleness", default="0,1,2")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="label for the figures")
    args, extra = ap.parse_known_args(argv)
    levels = [int(x) for x in args.staleness.split(",")]
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp:
        for level in levels:
            run_dir = run_one(args.profile, args.steps, level, Path(tmp), extra)
            results[level] = measure(run_dir, args.skip)
    sync = results.get(0)
    if sync is None:
        raise SystemExit("the baseline needs staleness 0 in --staleness")
    bound = sync["samples_per_step"] / max(
        sync["gen_busy_s_per_step"], sync["train_busy_s_per_step"]
    )
    config = {"profile": args.profile, "steps": args.steps, "skip": args.skip, "extra": extra}
    figs = []
    print(f"{'staleness':>9} {'samples/s':>10} {'gen idle':>9} {'train idle':>10}")
    for level, r in results.items():
        print(
            f"{level:>9} {r['samples_per_s']:>10.1f} {r['gen_idle_share']:>9.2f} "
            f"{r['train_idle_share']:>10.2f}"
        )
        detail = {**config, "staleness": level, **{k: round(v, 6) for k, v in r.items()}}
        figs.append(
            figure(
                "e2e",
                f"samples_per_s_staleness{level}",
                r["samples_per_s"],
                baseline="sync_staleness0",
                baseline_value=sync["samples_per_s"],
                bound=bound,
                config=detail,
                device=args.device,
            )
        )
    emit(figs, args.json)


if __name__ == "__main__":
    main()
