"""`python -m bench.trace_summary`: kernel time, idle gaps and kernel families of a
profiler trace, on a small synthetic Chrome trace written like torch.profiler's."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from bench.trace_summary import (
    family,
    launch_sites,
    load_events,
    load_kernels,
    main,
    summarize,
)


def _trace(path: Path) -> Path:
    def k(name: str, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 900.0},
        k("void pytorch_flash::flash_fwd_kernel<cutlass::bfloat16_t>", 100.0, 50.0),
        k("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN", 10.0, 40.0),  # out of order
        k("triton_poi_fused_cat_1", 160.0, 5.0),  # 10 us after the flash kernel: no gap
        k("_adamw_table_kernel", 400.0, 100.0),  # 235 us idle before it
        k("_rope_kernel", 450.0, 20.0),  # inside the optimizer kernel (another stream)
        k("void at::native::vectorized_elementwise_kernel<8, bfloat16_copy_kernel_cuda>", 530, 10),
    ]
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return path


def test_families_put_flash_before_gemms_and_copies_before_elementwise():
    assert family("void pytorch_flash::flash_bwd_kernel<cutlass::half_t>") == "attention"
    assert family("nvjet_sm90_tst_192x192") == "gemm"
    assert family("_adamw_table_kernel") == family("_sumsq_kernel") == "optimizer"
    assert family("vectorized_elementwise_kernel<bfloat16_copy_kernel_cuda>") == "copy"
    assert family("triton_poi_fused_cat_1") == "triton"
    assert family("_rope_kernel") == "other"


def test_summary_of_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = _trace(tmp_path / "trace.json.gz")
    kernels = load_kernels(path)
    assert [k["ts"] for k in kernels] == sorted(k["ts"] for k in kernels) and len(kernels) == 6
    s = summarize(kernels, gap_us=20.0)
    assert s["span_ms"] == pytest.approx(0.530)  # 10 us to 540 us
    assert s["kernel_ms"] == pytest.approx(0.225)
    gaps = [(round(g["us"]), g["after"]) for g in s["gaps"]]
    assert gaps == [
        (235, "triton_poi_fused_cat_1"),
        (50, "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN"),
        (30, "_adamw_table_kernel"),
    ]
    assert s["families"]["optimizer"] == pytest.approx(0.1)
    assert s["top"][0] == ("_adamw_table_kernel", pytest.approx(0.1), 1)
    main([str(path), "--top", "2"])
    out = capsys.readouterr().out
    assert "6 kernels, span 0.53 ms" in out and "0.235 ms" in out
    assert json.loads(out.strip().splitlines()[-1])["gap_ms"] == pytest.approx(0.315)


def _launch_trace(path: Path) -> Path:
    """Two host threads' ops and ranges, their launch calls and the kernels they queued."""

    def ev(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        ev("user_annotation", "train/forward", 0, 100),
        ev("cpu_op", "aten::where", 10, 30),  # launches through the fill nested in it
        ev("cpu_op", "aten::fill_", 12, 4),
        ev("cuda_runtime", "cudaLaunchKernel", 13, 1, corr=1),
        ev("cuda_runtime", "cudaLaunchKernel", 20, 1, corr=2),  # where's own kernel
        ev("cpu_op", "aten::sum", 50, 10),
        ev("cuda_runtime", "cudaLaunchKernel", 52, 1, corr=3),
        ev("cpu_op", "aten::sum", 70, 10),
        ev("cuda_runtime", "cudaLaunchKernel", 71, 1, corr=4),
        ev("cuda_runtime", "cudaGraphLaunch", 120, 2, corr=5),  # outside any op or range
        ev("cpu_op", "aten::mm", 10, 20, tid=2),  # another thread: its own nesting
        ev("cuda_runtime", "cudaLaunchKernel", 15, 1, tid=2, corr=6),
        ev("kernel", "fill", 200, 2, tid=7, corr=1),
        ev("kernel", "where", 203, 2, tid=7, corr=2),
        ev("kernel", "sum_a", 206, 3, tid=7, corr=3),
        ev("kernel", "sum_b", 210, 5, tid=7, corr=4),
        ev("kernel", "graph_k1", 300, 40, tid=7, corr=5),
        ev("kernel", "graph_k2", 341, 60, tid=7, corr=5),
        ev("kernel", "gemm", 500, 100, tid=7, corr=6),
        ev("kernel", "orphan", 700, 1, tid=7, corr=99),
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernels_by_the_op_that_launched_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = _launch_trace(tmp_path / "trace.json")
    rows = {(r, op): (n, ms) for r, op, n, ms in launch_sites(load_events(path))}
    assert rows == {
        ("cuda graph", "cudaGraphLaunch"): (2, pytest.approx(0.1)),
        ("train/forward", "aten::sum"): (2, pytest.approx(0.008)),
        ("train/forward", "aten::fill_"): (1, pytest.approx(0.002)),
        ("train/forward", "aten::where"): (1, pytest.approx(0.002)),
        ("-", "aten::mm"): (1, pytest.approx(0.1)),
        ("?", "?"): (1, pytest.approx(0.001)),
    }
    assert launch_sites(load_events(path))[0][:3] == ("cuda graph", "cudaGraphLaunch", 2)
    main([str(path), "--by-op", "--top", "2"])
    out = capsys.readouterr().out.split("launched by (range, CPU op):")[1]
    assert "aten::sum" in out and "cudaGraphLaunch" in out
    assert "aten::mm" not in out  # --top 2: the two rows with most kernels
