"""(d) The weight-sync bench runs on CPU with the tiny shape and prints valid JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import KEYS


def test_bench_tiny_cpu_prints_json_figures(tmp_path):
    out_file = tmp_path / "weight_sync.json"
    cmd = [sys.executable, "-m", "bench.weight_sync", "--shape", "tiny"]
    cmd += ["--device", "cpu", "--repeats", "1", "--json", str(out_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [f["figure"] for f in lines] == [
        "publish_seconds",
        "first_sync_seconds",
        "max_sync_seconds_after_first",
        "publish_gbps",
    ]
    for fig in lines:
        assert list(fig) == list(KEYS)
        assert fig["bench"] == "weight_sync" and fig["device"] == "cpu"
        for key in ("value", "baseline_value", "ratio", "bound", "fraction_of_bound"):
            assert isinstance(fig[key], float) and fig[key] > 0, key
        assert fig["config"]["shape"] == "tiny" and fig["config"]["transport"] == "gloo"
    assert json.loads(out_file.read_text()) == lines
    assert done.stdout.splitlines()[1].startswith("figure")  # the human table comes first


def test_bench_with_a_tp2_replica_halves_the_bytes_each_engine_rank_receives():
    cmd = [sys.executable, "-m", "bench.weight_sync", "--shape", "tiny"]
    cmd += ["--device", "cpu", "--repeats", "1", "--tp", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    fig = lines[0]
    assert list(fig) == list(KEYS) and fig["figure"] == "bytes_per_engine_rank"
    assert fig["baseline"] == "whole_model_engine" and fig["config"]["tp"] == 2
    # every tensor split in two but the replicated norms (and bucket alignment)
    assert 0.5 <= fig["ratio"] <= 0.51, fig
    assert fig["value"] >= fig["bound"]
