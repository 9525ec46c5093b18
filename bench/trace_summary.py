"""Where a profiled step's device time went, from a `--trace` file of the benches.

    python -m bench.trace_summary TRACE.json[.gz] [--top 30] [--gap-us 20]

Reads the Chrome trace that torch.profiler wrote (`learner_step --torch-profile --trace`)
and prints: the span from the first kernel's start to the last kernel's end, the sum of
kernel durations, the device-idle gaps longer than `--gap-us` (the longest first, with the
kernel that ended each), the time per kernel family, and the kernels with the most time.
Families are matched by name, flash attention before GEMMs (its kernels' names contain
"cutlass" too). With `--by-op` (a trace with CPU activity, as the benches' single-step
`--torch-profile` trace has) also where the kernels were launched from: each kernel is
matched by its correlation id to the host's launch call and so to the innermost CPU op and
record_function range around that call (kernels of a CUDA graph replay count as one line:
the graph's). Ends with one JSON line of the totals.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path
from typing import Any

# (family, substrings of a lower-cased kernel name): the first match wins
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("optimizer", ("adam", "sumsq")),
    ("triton", ("triton",)),
    ("copy", ("copy", "memcpy", "cat")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "foreach", "multi_tensor")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def load_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a Chrome trace file (.json or .json.gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def load_kernels(path: Path) -> list[dict[str, Any]]:
    """The trace's kernel events (name, ts and dur in microseconds), by start time."""
    return _kernels(load_events(path))


def _kernels(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda e: e["ts"])


class _Intervals:
    """One thread's nested (ts, dur) events: the innermost one around a time."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def innermost(self, ts: float) -> dict[str, Any] | None:
        # nested intervals: the latest-starting one that still contains ts
        for i in range(bisect.bisect_right(self.starts, ts) - 1, -1, -1):
            e = self.events[i]
            if e["ts"] + e["dur"] >= ts:
                return e
        return None


def launch_sites(events: list[dict[str, Any]]) -> list[tuple[str, str, int, float]]:
    """(record_function range, CPU op, kernels, ms) per launching op, most kernels first;
    kernels without a matching launch call count under ("?", "?"), a CUDA graph's under
    ("cuda graph", the launch call)."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    by_thread: dict[tuple[str, Any], list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            by_thread[e["cat"], e.get("tid")].append(e)
    intervals = {key: _Intervals(v) for key, v in by_thread.items()}
    none = _Intervals([])
    sites: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for k in _kernels(events):
        call = launches.get(k.get("args", {}).get("correlation"))
        if call is None:
            key = ("?", "?")
        elif "graph" in call["name"].lower():
            key = ("cuda graph", call["name"])
        else:
            tid = call.get("tid")
            op = intervals.get(("cpu_op", tid), none).innermost(call["ts"])
            rng = intervals.get(("user_annotation", tid), none).innermost(call["ts"])
            key = ((rng or {}).get("name", "-"), (op or {}).get("name", "-"))
        sites[key][0] += 1
        sites[key][1] += k["dur"]
    rows = [(r, op, int(n), us / 1e3) for (r, op), (n, us) in sites.items()]
    return sorted(rows, key=lambda row: (-row[2], -row[3]))


def summarize(kernels: list[dict[str, Any]], gap_us: float = 20.0) -> dict[str, Any]:
    if not kernels:
        return {"kernels": 0, "span_ms": 0.0, "kernel_ms": 0.0, "gap_ms": 0.0, "gaps": [],
                "families": {}, "top": []}  # fmt: skip
    start = kernels[0]["ts"]
    end = kernels[0]["ts"] + kernels[0]["dur"]
    last = kernels[0]["name"]
    gaps = []
    for k in kernels[1:]:
        if k["ts"] - end > gap_us:
            gaps.append({"us": k["ts"] - end, "at_ms": (end - start) / 1e3, "after": last})
        if k["ts"] + k["dur"] >= end:
            end, last = k["ts"] + k["dur"], k["name"]
    fams: collections.Counter[str] = collections.Counter()
    names: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for k in kernels:
        fams[family(k["name"])] += k["dur"]
        names[k["name"]] += k["dur"]
        counts[k["name"]] += 1
    return {
        "kernels": len(kernels),
        "span_ms": (end - start) / 1e3,
        "kernel_ms": sum(k["dur"] for k in kernels) / 1e3,
        "gap_ms": sum(g["us"] for g in gaps) / 1e3,
        "gaps": sorted(gaps, key=lambda g: -g["us"]),
        "families": {f: v / 1e3 for f, v in fams.most_common()},
        "top": [(n, v / 1e3, counts[n]) for n, v in names.most_common()],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=30, help="kernels and gaps listed")
    ap.add_argument("--gap-us", type=float, default=20.0, help="shortest idle gap listed")
    ap.add_argument(
        "--by-op", action="store_true", help="also the kernels per launching CPU op and range"
    )
    args = ap.parse_args(argv)
    events = load_events(args.trace)
    s = summarize(_kernels(events), args.gap_us)
    print(
        f"{s['kernels']} kernels, span {s['span_ms']:.2f} ms, kernel time {s['kernel_ms']:.2f} ms"
    )
    print(f"idle gaps > {args.gap_us:g} us: {s['gap_ms']:.2f} ms")
    for g in s["gaps"][: args.top]:
        print(f"  {g['us'] / 1e3:7.3f} ms at {g['at_ms']:8.2f} ms after {g['after'][:80]}")
    print("by family:")
    for fam, ms in s["families"].items():
        print(f"  {fam:12s} {ms:8.3f} ms")
    print("kernels:")
    for name, ms, n in s["top"][: args.top]:
        print(f"  {ms:8.3f} ms  n={n:<5d} {name[:100]}")
    if args.by_op:
        print("launched by (range, CPU op):")
        for rng, op, n, ms in launch_sites(events)[: args.top]:
            print(f"  n={n:<5d} {ms:8.3f} ms  {rng[:30]:30s} {op[:80]}")
    totals = {k: round(v, 3) for k, v in s.items() if isinstance(v, float)}
    families = {f: round(ms, 3) for f, ms in s["families"].items()}
    print(json.dumps({"kernels": s["kernels"], **totals, "families": families}))


if __name__ == "__main__":
    main()
