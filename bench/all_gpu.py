"""Every GPU benchmark in one call, each in its own subprocess with a time limit.

    python -m bench.all_gpu --out bench/results [--only weight_sync,rollout_decode]
        [--device cuda]

Order: weight_sync (0.5B, then 7B shape; short), rollout_decode (0.5B), learner_step (0.5B),
then e2e (a random 0.5B model on `profiles/h200-single.toml`, and on `profiles/h200-x2.toml`
when two GPUs are visible; BENCH_E2E_STEPS steps each, default 16). A bench whose module is missing is skipped with a
note; one that fails or runs past its limit is reported and the others still run (e2e writes
its figures after each of its runs, so one killed at its limit keeps the runs it finished). Each bench
gets min(BENCH_TIMEOUT_S (default 240; BENCH_TIMEOUT_S_<BENCH> for one bench, e.g.
BENCH_TIMEOUT_S_ROLLOUT_DECODE), the time left of BENCH_TOTAL_S (default 570)) seconds, so the
whole call fits in ten minutes. The figures of each bench go to
`<out>/<bench>-<device>.json` (device from the figures, e.g. "NVIDIA H200" -> h200; the two
weight_sync shapes share one file, told apart by config.shape); a summary table ends the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 240.0
DEFAULT_TOTAL_S = 570.0
MIN_USEFUL_S = 20.0  # do not start a bench with less time than this left


@dataclass
class Job:
    """One bench invocation; several jobs may write one bench's file."""

    name: str  # label in the summary
    bench: str  # module under bench, and the results file stem
    args: list[str]


@dataclass
class Outcome:
    job: Job
    status: str  # ok | failed | timeout | skipped
    seconds: float = 0.0
    note: str = ""
    figures: list[dict[str, Any]] = field(default_factory=list)


def jobs(device: str) -> list[Job]:
    """The GPU figures; with --device cpu the same sequence on the tiny shape (a smoke run)."""
    dev = ["--device", device]
    sync_shapes, shape = (["0.5b", "7b"], "0.5b") if device == "cuda" else (["tiny"], "tiny")
    return [
        *(Job(f"weight_sync {s}", "weight_sync", [*dev, "--shape", s]) for s in sync_shapes),
        Job(f"rollout_decode {shape}", "rollout_decode", [*dev, "--shape", shape]),
        Job(f"learner_step {shape}", "learner_step", [*dev, "--shape", shape]),
        Job(f"kernels {shape}", "kernels", [*dev, "--shape", shape]),
        *cold_start_jobs(device),
        *e2e_jobs(device),
    ]


def cold_start_jobs(device: str) -> list[Job]:
    """A short run cold and warm on one GPU (BENCH_COLD_VARIANTS, default "grpo,ppo")."""
    if device != "cuda":
        return [Job("cold_start", "cold_start", ["--device", "cpu", "--shape", "", "--steps", "3",
                                                 "--profile", "profiles/local-cpu.toml",
                                                 "--variants", "grpo"])]  # fmt: skip
    variants = os.environ.get("BENCH_COLD_VARIANTS", "grpo,ppo")
    return [Job("cold_start", "cold_start", ["--device", "cuda", "--variants", variants])]


def e2e_jobs(device: str) -> list[Job]:
    """Async vs sync end to end on one shared GPU, and split over two GPUs when there are.

    BENCH_E2E_STEPS (16), BENCH_E2E_STALENESS ("0,1,2"), BENCH_E2E_PROFILES (both) and
    BENCH_E2E_RUNS (keep the run directories there) tune them."""
    if device != "cuda":
        return [Job("e2e", "e2e", ["--device", "cpu", "--steps", "20"])]
    import torch

    env = os.environ.get
    common = ["--device", "cuda", "--shape", "0.5b", "--skip", "3"]
    common += ["--steps", env("BENCH_E2E_STEPS", "16")]
    common += ["--staleness", env("BENCH_E2E_STALENESS", "0,1,2")]
    if env("BENCH_E2E_RUNS"):
        common += ["--runs-dir", env("BENCH_E2E_RUNS", "")]
    wanted = env("BENCH_E2E_PROFILES", "h200-single,h200-x2").split(",")
    if torch.cuda.device_count() < 2 and "h200-x2" in wanted:
        wanted.remove("h200-x2")
    return [
        Job(f"e2e {name}", "e2e", ["--profile", f"profiles/{name}.toml", *common])
        for name in wanted
    ]


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'cpu (AMD EPYC)' -> 'cpu'."""
    if name.startswith("cpu"):
        return "cpu"
    slug = re.sub(r"^nvidia\s+", "", name.strip().lower())
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return slug or "unknown"


def _module_exists(bench: str) -> bool:
    return importlib.util.find_spec(f"bench.{bench}") is not None


def _tail(path: Path, lines: int) -> str:
    """The log's last lines, without the JSON figure lines (the summary shows those)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([line for line in text if not line.startswith("{")][-lines:])


def bench_limit(bench: str) -> float:
    """BENCH_TIMEOUT_S_<BENCH> (e.g. BENCH_TIMEOUT_S_ROLLOUT_DECODE), else BENCH_TIMEOUT_S."""
    default = float(os.environ.get("BENCH_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    return float(os.environ.get(f"BENCH_TIMEOUT_S_{bench.upper()}", default))


def run_job(job: Job, device: str, limit_s: float, tmp: Path) -> Outcome:
    """Run one bench in its own session (killed as a group at the limit)."""
    if not _module_exists(job.bench):
        return Outcome(job, "skipped", note=f"bench.{job.bench} does not exist")
    if limit_s < MIN_USEFUL_S:
        return Outcome(job, "skipped", note=f"only {limit_s:.0f} s left of BENCH_TOTAL_S")
    args = list(job.args)
    stem = re.sub(r"[^a-z0-9]+", "-", job.name.lower())
    json_path = tmp / f"{stem}.json"
    log_path = tmp / f"{stem}.log"
    cmd = [sys.executable, "-m", f"bench.{job.bench}", *args, "--json", str(json_path)]
    print(f"\n=== {job.name}: {' '.join(cmd[1:])}  (limit {limit_s:.0f} s)", flush=True)
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the bench's own session: it and its workers
            proc.wait()
            rc = None
    seconds = time.monotonic() - start
    print(_tail(log_path, 40), flush=True)
    if rc is None:  # a bench that writes as it goes (e2e) leaves what it finished
        partial = _figures(json_path)
        note = f"killed after {limit_s:.0f} s" + (
            f"; kept {len(partial)} figures" if partial else ""
        )
        return Outcome(job, "timeout", seconds, note, figures=partial)
    if rc != 0:
        return Outcome(job, "failed", seconds, f"exit code {rc}")
    try:
        figures = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        return Outcome(job, "failed", seconds, f"no readable --json output: {exc}")
    return Outcome(job, "ok", seconds, figures=figures)


def _figures(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text()))
    except (OSError, ValueError):
        return []


def write_results(outcomes: list[Outcome], out: Path) -> dict[str, Path]:
    """Figures of finished (or partly finished) jobs, merged per bench, to <out>/<bench>-<device>.json."""
    merged: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for o in outcomes:
        for fig in o.figures:
            key = (o.job.bench, device_slug(str(fig.get("device", "unknown"))))
            merged.setdefault(key, []).append(fig)
    written: dict[str, Path] = {}
    out.mkdir(parents=True, exist_ok=True)
    for (bench, slug), figs in merged.items():
        path = out / f"{bench}-{slug}.json"
        path.write_text(json.dumps(figs, indent=1) + "\n")
        written[bench] = path
    return written


def summary(outcomes: list[Outcome], written: dict[str, Path]) -> str:
    lines = [f"{'bench':<22}{'status':<9}{'seconds':>8}  result"]
    for o in outcomes:
        head = f"{o.job.name:<22}{o.status:<9}{o.seconds:>8.1f}  "
        if o.status != "ok":
            lines.append(head + o.note)
            continue
        lines.append(head + f"-> {written.get(o.job.bench, '?')}")
        for f in o.figures:
            try:
                lines.append(
                    f"{'':<41}{f['figure']:<28} {f['value']:>12.6g}  x{f['ratio']:.3f} vs "
                    f"{f['baseline']}  {f['fraction_of_bound']:.3f} of bound"
                )
            except (KeyError, TypeError, ValueError):  # a bench off the common format
                lines.append(f"{'':<41}{json.dumps(f)[:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.all_gpu")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--only", default=None, help="comma-separated bench names to run")
    args = ap.parse_args(argv)
    total = float(os.environ.get("BENCH_TOTAL_S", DEFAULT_TOTAL_S))
    selected = jobs(args.device)
    if args.only:
        wanted = {x.strip() for x in args.only.split(",") if x.strip()}
        unknown = wanted - {j.bench for j in selected}
        if unknown:
            raise SystemExit(f"--only: unknown bench(es) {sorted(unknown)}")
        selected = [j for j in selected if j.bench in wanted]
    deadline = time.monotonic() + total
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="all-gpu-") as tmp:
        for job in selected:
            left = deadline - time.monotonic()
            outcomes.append(run_job(job, args.device, min(bench_limit(job.bench), left), Path(tmp)))
    written = write_results(outcomes, args.out)
    print("\n" + summary(outcomes, written), flush=True)
    if any(o.status in ("failed", "timeout") for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
