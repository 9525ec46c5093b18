"""The transport bench runs end to end in a tiny configuration and prints valid figures.

Numbers are not checked (a shared 2-core machine makes them noise at this duration); the
format is, because other tools and the README read these lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.common import KEYS

FIGURES = [
    f"{kind}_{size}" for size in ("1KiB", "1MiB", "64MiB") for kind in ("msgs_per_s", "gbps")
]


def test_transport_bench_prints_json_figures(tmp_path: Path) -> None:
    out_file = tmp_path / "transport.json"
    cmd = [sys.executable, "-m", "bench.transport", "--json", str(out_file)]
    cmd += ["--seconds", "0.05", "--warmup", "0.05", "--repeats", "1", "--min-msgs", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    figs = [json.loads(line) for line in lines if line.startswith("{")]
    assert [f["figure"] for f in figs] == FIGURES
    for fig in figs:
        assert list(fig) == list(KEYS)
        assert fig["bench"] == "transport"
        assert fig["baseline"] == "raw_pyzmq_push_pull"
        assert fig["device"].startswith("cpu (")
        assert fig["git"] and fig["date"]
        for key in ("value", "baseline_value", "ratio", "bound", "fraction_of_bound"):
            assert isinstance(fig[key], float) and fig[key] > 0, key
        assert abs(fig["ratio"] - fig["value"] / fig["baseline_value"]) < 1e-3 * fig["ratio"] + 1e-4
        config = fig["config"]
        assert config["acks"] is True and config["transport"] == "ipc"
        assert config["prefetch"] >= 1 and config["repeats"] == 1
    # the JSON lines come last, after the human table; --json holds the same list
    assert all(line.startswith("{") for line in lines[-len(FIGURES) :])
    assert any(line.startswith("figure") for line in lines[: -len(FIGURES)])
    assert json.loads(out_file.read_text()) == figs
