"""`--torch-profile` of the benches: one more call under torch.profiler, printed as two
tables (by device time, by host time) and a one-line JSON summary of where the wall time
went: device busy time (union of kernel intervals), kernel launches, host syncs, and the
host time of each `record_function` range the code under test marks (e.g. the trainer's
train/forward, train/backward, train/optimizer)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.common import covered


def summarize(prof: Any, wall_s: float, ranges: Sequence[str]) -> dict[str, Any]:
    """Wall vs device-busy time, launches and syncs, host ms per marked range."""
    kernels: list[tuple[float, float]] = []
    range_ms: dict[str, float] = {r: 0.0 for r in ranges}
    calls: dict[str, int] = {}
    counted = ("cudaLaunchKernel", "cuLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync")
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((ev.time_range.start, ev.time_range.end))
            continue
        if ev.name in range_ms:
            range_ms[ev.name] += (ev.time_range.end - ev.time_range.start) / 1e3
        for name in counted:
            if ev.name.startswith(name):
                calls[name] = calls.get(name, 0) + 1
    busy_ms = covered(kernels) / 1e3
    return {
        "wall_ms": round(wall_s * 1e3, 2),
        "device_busy_ms": round(busy_ms, 2),
        "device_idle_ms": round(wall_s * 1e3 - busy_ms, 2),
        "kernels": len(kernels),
        "host_calls": calls,
        "host_ms_per_range": {k: round(v, 2) for k, v in range_ms.items()},
    }


def print_profile(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    rows: int = 25,
    ranges: Sequence[str] = (),
    trace: str | None = None,
) -> dict[str, Any]:
    """Run `fn` once under torch.profiler; print the tables and the summary, return it.
    `trace`: also write the timeline there (Chrome trace JSON, gzipped when it ends .gz)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows), flush=True)
    if trace:
        _write_trace(prof, trace)
    summary = summarize(prof, wall, ranges)
    print("profile_summary " + json.dumps(summary), flush=True)
    return summary


def _write_trace(prof: Any, path: str) -> None:
    import gzip
    import os
    import tempfile

    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())


def sync_sites(fn: Callable[[], Any], device: torch.device, *, top: int = 20) -> dict[str, int]:
    """Run `fn` once with CUDA's sync debug mode on: every operation that makes the host wait
    for the device warns. Returns (and prints) the count per source line."""
    import collections
    import warnings

    if device.type != "cuda":
        return {}
    counts: collections.Counter[str] = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{w.filename}:{w.lineno}"] += 1
    sites = dict(counts.most_common(top))
    print("sync_sites " + json.dumps(sites), flush=True)
    return sites
