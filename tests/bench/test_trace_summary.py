"""`python -m pipeline.bench.trace_summary`: kernel time, idle gaps and kernel families of a
profiler trace, on a small synthetic Chrome trace written like torch.profiler's."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pipeline.bench.trace_summary import family, load_kernels, main, summarize


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
