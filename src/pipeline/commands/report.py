"""`pipeline report RUN`: PNG plots, TensorBoard events and a Perfetto trace of a run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PLOTS = {
    "reward": ["reward_mean"],
    # multi-turn runs: the share of episodes that used their tool well, beside the reward
    "tool_use": ["reward_mean", "rollout/tool_used"],
    "kl": ["kl/k3", "kl/k1", "mismatch/kl"],
    "entropy": ["actor/entropy"],
    "tokens_per_s": ["tokens_per_s"],
    "staleness": ["staleness_max", "staleness_mean"],
    "sync_seconds": ["sync_seconds"],
}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    return _jsonl(run_dir / "metrics" / "steps.jsonl")


def write_plots(run_dir: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = steps_of(run_dir)
    written = []
    for name, keys in PLOTS.items():
        present = [k for k in keys if any(k in s for s in steps)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for key in present:
            xs = [s["step"] for s in steps if key in s]
            ax.plot(xs, [s[key] for s in steps if key in s], label=key)
        ax.set_xlabel("step")
        ax.set_title(f"{run_dir.name}: {name}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_trace(run_dir: Path, out: Path) -> Path:
    """Chrome trace-event JSON (opens in Perfetto): one track per service replica."""
    events: list[dict[str, Any]] = []
    t0: float | None = None
    spans = []
    for path in sorted((run_dir / "metrics").glob("*-*.jsonl")):
        service = path.stem
        for record in _jsonl(path):
            if record.get("kind") == "span":
                spans.append((service, record))
                t0 = record["start"] if t0 is None else min(t0, record["start"])
    for pid, service in enumerate(sorted({s for s, _ in spans})):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": service}})
        lanes: list[float] = []
        for _, record in sorted((p for p in spans if p[0] == service), key=lambda p: p[1]["start"]):
            lane = next((i for i, end in enumerate(lanes) if end <= record["start"]), len(lanes))
            if lane == len(lanes):
                lanes.append(0.0)
            lanes[lane] = record["end"]
            args = {
                k: v for k, v in record.items() if k not in ("kind", "name", "start", "end", "time")
            }
            events.append(
                {
                    "name": record["name"],
                    "ph": "X",
                    "pid": pid,
                    "tid": lane,
                    "ts": (record["start"] - (t0 or 0)) * 1e6,
                    "dur": max(0.0, record["end"] - record["start"]) * 1e6,
                    "args": args,
                }
            )
    path = out / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def make_report(run_dir: Path) -> dict[str, Any]:
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(run_dir, out)
    trace = write_trace(run_dir, out)
    tensorboard = run_dir / "tensorboard"  # written live by the controller (step_log.py)
    steps = steps_of(run_dir)
    first = [s["reward_mean"] for s in steps[:10] if "reward_mean" in s]
    last = [s["reward_mean"] for s in steps[-10:] if "reward_mean" in s]
    summary = {
        "steps": len(steps),
        "reward_first10": sum(first) / len(first) if first else None,
        "reward_last10": sum(last) / len(last) if last else None,
        "plots": [str(p) for p in plots],
        "trace": str(trace),
        "tensorboard": str(tensorboard),
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    return summary


def report_command(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if not (run_dir / "metrics").exists():
        print(f"error: {run_dir} has no metrics/; is it a run directory?")
        return 2
    print(json.dumps(make_report(run_dir), indent=2))
    return 0
