"""The figure format every bench shares (see docs/performance.md), built, printed and written once.

A figure is only worth quoting next to the baseline and the bound measured in the same run,
with the commit, the device and the config that produced it; building all of them here
keeps the benches' JSON lines identical in keys and order, so one reader parses them all.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

KEYS = (
    "bench",
    "figure",
    "value",
    "baseline",
    "baseline_value",
    "ratio",
    "bound",
    "fraction_of_bound",
    "device",
    "config",
    "git",
    "date",
)


def git_sha(cwd: Path | None = None) -> str:
    """$PIPELINE_GIT_SHA (for a copied tree whose .git is not current, e.g. a GPU host that
    receives the working tree), else `git rev-parse HEAD` of this checkout with "+dirty"
    when tracked files differ from it (a figure then does not belong to that commit: a GPU
    host's stale .git once put the previous session's commit on a result), or "unknown"."""
    if os.environ.get("PIPELINE_GIT_SHA"):
        return os.environ["PIPELINE_GIT_SHA"]
    where = cwd or Path(__file__).resolve().parent
    head = _git(["rev-parse", "HEAD"], where)
    if not head:
        return "unknown"
    changed = _git(["status", "--porcelain", "--untracked-files=no"], where)
    return head + "+dirty" if changed else head


def _git(args: list[str], cwd: Path) -> str:
    """stdout of a git command, stripped ("" when git fails or is missing)."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: overlaps counted once, empty or
    reversed intervals ignored."""
    total, cursor = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        lo = max(lo, cursor)
        if hi > lo:
            total += hi - lo
            cursor = hi
    return total


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def cpu_name() -> str:
    """The CPU model as the kernel reports it; timings on shared machines need it beside them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_device() -> str:
    return f"cpu ({cpu_name()})"


def _num(x: float, digits: int = 6) -> float:
    """Round to significant digits: msgs/s and GB/s span ten orders of magnitude."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


def device_defaults(args: Any, defaults: dict[str, dict[str, Any]]) -> None:
    """Fill a GPU bench's arguments in place: --device left out is cuda where there is one,
    else cpu; then every option of `defaults[device]` left out (None) takes its value."""
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in defaults[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def figure(
    bench: str,
    name: str,
    value: float,
    *,
    baseline: str,
    baseline_value: float,
    bound: float,
    config: dict[str, Any],
    device: str,
    lower_is_better: bool = False,
    git: str | None = None,
    date: str | None = None,
) -> dict[str, Any]:
    """One figure. `ratio` > 1 always means better than the baseline, and `fraction_of_bound`
    <= 1 how close to the bound we get, whichever way the unit points (seconds vs. GB/s)."""
    if lower_is_better:
        ratio, of_bound = baseline_value / value, bound / value
    else:
        ratio, of_bound = value / baseline_value, value / bound
    return {
        "bench": bench,
        "figure": name,
        "value": _num(value),
        "baseline": baseline,
        "baseline_value": _num(baseline_value),
        "ratio": round(ratio, 4),
        "bound": _num(bound),
        "fraction_of_bound": round(of_bound, 4),
        "device": device,
        "config": config,
        "git": git if git is not None else git_sha(),
        "date": date if date is not None else now_iso(),
    }


def table(figures: Sequence[dict[str, Any]]) -> str:
    """The human-readable table printed before the JSON lines."""
    width = max([len("figure"), *(len(f["figure"]) for f in figures)]) + 2
    lines = [
        f"{'figure':<{width}}{'value':>14}{'baseline':>14}{'ratio':>8}{'bound':>14}{'of bound':>10}"
    ]
    for f in figures:
        lines.append(
            f"{f['figure']:<{width}}{f['value']:>14.6g}{f['baseline_value']:>14.6g}"
            f"{f['ratio']:>8.3f}{f['bound']:>14.6g}{f['fraction_of_bound']:>10.3f}"
        )
    return "\n".join(lines)


def emit(figures: Iterable[dict[str, Any]], json_path: str | Path | None = None) -> None:
    """Print one JSON object per line (last thing on stdout); with a path, also write the list."""
    figs = [{k: f[k] for k in KEYS} for f in figures]
    for f in figs:
        print(json.dumps(f), flush=True)
    if json_path is not None:
        emit_file(figs, json_path)


def emit_file(figures: Iterable[dict[str, Any]], json_path: str | Path) -> None:
    """Write the figures' list to `json_path` (no printing)."""
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{k: f[k] for k in KEYS} for f in figures], indent=1) + "\n")
