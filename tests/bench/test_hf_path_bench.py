"""bench/hf_path.py runs end to end in a tiny configuration and prints its figure (the
README quotes it); the number itself is noise at this size on a shared machine."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import KEYS


def test_hf_path_bench_prints_its_figure(tmp_path):
    cmd = [sys.executable, "-m", "bench.hf_path", "--json", str(tmp_path / "f.json")]
    cmd += ["--batch", "8", "--seq", "12", "--prompt", "6", "--warmup", "0", "--steps", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"bench"')]
    [fig] = lines
    assert list(fig) == list(KEYS) and fig["figure"] == "learner_tokens_per_s_transformers"
    assert fig["baseline"] == "native decoder" and fig["value"] > 0 and fig["baseline_value"] > 0
    assert json.loads((tmp_path / "f.json").read_text()) == [fig]
