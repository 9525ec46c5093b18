"""`pipeline run` end to end with real service processes; then inspect and replay its run dir."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.wire import codec
from pipeline.wire.recording import QueueReader

REPO = Path(__file__).resolve().parents[2]
PIPELINE = [sys.executable, "-m", "pipeline.cli"]


@pytest.fixture(scope="module")
def standin_run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(
        [
            *PIPELINE,
            "run",
            "--profile",
            str(REPO / "profiles/local-cpu.toml"),
            "--name",
            "e2e",
            "--no-progress",
            "--run.runs_dir",
            str(runs),
            "--controller.steps",
            "4",
            # the plumbing alone: no engine, no training (tests/standin/)
            "--services.rollout.module",
            "tests.standin.rollout",
            "--services.learner.module",
            "tests.standin.learner",
            "--task.warm_start_steps",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs / "e2e"


def test_run_starts_five_processes_ends_by_itself_and_accounts_for_every_uid(standin_run):
    supervisor = json.loads((standin_run / "supervisor.json").read_text())
    pids = {e["started"] for e in supervisor["events"] if "started" in e}
    assert len(pids) >= 5
    summary = json.loads((standin_run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4
    assert summary["trained"] == summary["released"] - summary["dropped"]
    assert summary["duplicates"] == 0 and summary["in_flight_at_end"] == 0
    for name in ("config.json", "logs/learner-0.log", "metrics/steps.jsonl"):
        assert (standin_run / name).exists(), name
    steps = [json.loads(x) for x in (standin_run / "metrics/steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]


def test_services_start_while_the_controller_prepares(standin_run):
    """Every service is launched with the controller, not once it has prepared the run
    (`run.json`): their imports and model loads overlap its preparation."""
    supervisor = json.loads((standin_run / "supervisor.json").read_text())
    starts = {e["service"]: e["time"] for e in supervisor["events"] if "started" in e}
    prepared = (standin_run / "run.json").stat().st_mtime
    assert len(starts) >= 5
    assert all(t < prepared for t in starts.values()), (starts, prepared)


def test_inspect_reads_the_run_and_exports(standin_run, tmp_path):
    out_jsonl, out_parquet = tmp_path / "scored.jsonl", tmp_path / "scored.parquet"
    proc = subprocess.run(
        [
            *PIPELINE,
            "inspect",
            str(standin_run),
            "--queue",
            "scored",
            "--jsonl",
            str(out_jsonl),
            "--parquet",
            str(out_parquet),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out_jsonl.read_text().splitlines()]
    summary = json.loads((standin_run / "summary.json").read_text())
    # the learner records what it received: trained groups and the ones dropped as stale
    assert len({r["uid"] for r in rows}) == summary["trained"] + summary["dropped"]
    n_samples = json.loads((standin_run / "config.json").read_text())["rollout"]["n_samples"]
    assert all(r["type"] == "SCORED" and r["n_samples"] == n_samples for r in rows)
    import pyarrow.parquet as pq

    assert pq.read_table(out_parquet).num_rows == len(rows)
    first = rows[0]["uid"]
    proc = subprocess.run(
        [
            *PIPELINE,
            "inspect",
            str(standin_run),
            "--queue",
            "scored",
            "--uid",
            first,
            "--jsonl",
            str(tmp_path / "one.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert len((tmp_path / "one.jsonl").read_text().splitlines()) == 1


def _by_uid(path: Path) -> dict[str, codec.Message]:
    return {m.body.uid: m for m in (codec.decode(r.frames) for r in QueueReader(path))}


def _same(a: codec.Message, b: codec.Message) -> bool:
    if a.body.uid != b.body.uid or len(a.body.samples) != len(b.body.samples):
        return False
    for sa, sb in zip(a.body.samples, b.body.samples, strict=True):
        if (sa.uid, sa.score, sa.response_text) != (sb.uid, sb.score, sb.response_text):
            return False
        for name in ("response_ids", "behaviour_logprobs", "token_versions"):
            if not np.array_equal(a.tensor(getattr(sa, name)), b.tensor(getattr(sb, name))):
                return False
    return True


def test_replayed_queue_reproduces_the_recorded_outputs(standin_run, tmp_path):
    """The recorded `rollouts` queue fed into a fresh reward service gives the recorded `scored`."""
    out = tmp_path / "replay"
    start = time.monotonic()
    proc = subprocess.run(
        [*PIPELINE, "replay", str(standin_run), "--service", "reward", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - start < 60
    original = _by_uid(standin_run / "queues/scored.log")
    replayed = _by_uid(out / "queues/scored.log")
    assert set(replayed) == set(_by_uid(standin_run / "queues/rollouts.log"))
    assert set(original) <= set(replayed)
    assert all(_same(original[uid], replayed[uid]) for uid in original)


def test_a_truncated_or_damaged_recording_is_refused_by_replay_with_the_offset(
    standin_run, tmp_path
):
    """Half a queue log: `pipeline replay` says where it ends and exits 1, or replays the
    records before it with --allow-truncated and warns; a record that does not decode is
    an error with its offset, not a traceback (issue 33, defect 5: before, 321 of 640
    records replayed with exit code 0 and no word)."""
    run = tmp_path / "run"
    shutil.copytree(standin_run, run, ignore=shutil.ignore_patterns("replay"))
    log = run / "queues/rollouts.log"
    whole = log.read_bytes()
    offsets = [r.offset for r in QueueReader(log)]
    log.write_bytes(whole[: offsets[len(offsets) // 2] + 11])
    cmd = [*PIPELINE, "replay", str(run), "--service", "reward", "--out", str(tmp_path / "o")]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert f"truncated at offset {offsets[len(offsets) // 2]}" in refused.stderr
    assert "Traceback" not in refused.stderr
    allowed = subprocess.run([*cmd, "--allow-truncated"], capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "warning: the recording is truncated" in allowed.stderr
    assert json.loads(allowed.stdout)["inputs"] == len(offsets) // 2
    # a record whose body is garbage: frames intact, the message does not decode
    damaged = bytearray(whole)
    (n_frames,) = struct.unpack_from("<I", whole, offsets[1] + 8)
    first = offsets[1] + 20 + 8 * n_frames  # record 1's header frame
    damaged[first : first + 8] = b"\xc1" * 8
    log.write_bytes(bytes(damaged))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "pipeline replay: error:" in bad.stderr
