"""`pipeline inspect`: read recorded queues, filter by uid/step/version, print, export."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import RecordingError, SchemaMismatch
from pipeline.wire.recording import QueueReader


def _schedule(run_dir: Path) -> dict[str, int]:
    path = run_dir / "schedule.jsonl"
    steps: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                steps[rec["uid"].rsplit("/", 1)[0]] = rec["step"]
    return steps


def record_rows(path: Path, steps: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    """One flat row per recorded message (samples summarised)."""
    reader = QueueReader(path)
    for record in reader:
        try:
            msg = record.decode()
        except SchemaMismatch as exc:
            yield {"queue": reader.header.queue, "index": record.index, "error": str(exc)}
            continue
        body = msg.body
        row: dict[str, Any] = {
            "queue": reader.header.queue,
            "index": record.index,
            "time": round(record.wall_time, 6),
            "type": msg.type.name,
            "uid": getattr(body, "uid", ""),
            "sender": msg.header.sender,
            "seq": msg.header.seq,
            "released_version": getattr(body, "released_version", None),
        }
        if steps is not None:
            row["step"] = steps.get(row["uid"])
        samples = getattr(body, "samples", None)
        if samples is not None:
            row["n_samples"] = len(samples)
            row["scores"] = [s.score for s in samples]
            row["response_lens"] = [s.response_ids.shape[0] for s in samples]
            versions = [msg.tensor(s.token_versions) for s in samples]
            row["min_version"] = min((int(v.min()) for v in versions if v.size), default=None)
            row["responses"] = [s.response_text for s in samples]
        else:
            row["prompt"] = getattr(body, "prompt_text", "")
        yield row
    if reader.truncated:
        yield {
            "queue": reader.header.queue,
            "index": -1,
            "error": f"truncated at offset {reader.truncated_at} of {reader.size} (ignored)",
        }


def _matches(row: dict[str, Any], args: argparse.Namespace) -> bool:
    if args.uid and not str(row.get("uid", "")).startswith(args.uid):
        return False
    if args.step is not None and row.get("step") != args.step:
        return False
    return args.version is None or row.get("released_version") == args.version


def inspect_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    target = Path(args.run)
    if target.is_file():
        files, run_dir = [target], target.parent.parent
    else:
        run_dir = target
        queues = run_dir / "queues"
        files = sorted(queues.glob(f"{args.queue}.log" if args.queue else "*.log"))
        if not files:
            print(f"error: no recorded queues under {queues}")
            return 2
    steps = _schedule(run_dir)
    rows: list[dict[str, Any]] = []
    try:
        for path in files:
            rows.extend(r for r in record_rows(path, steps) if _matches(r, args))
    except RecordingError as exc:
        print(f"error: {exc}")
        return 2
    console = Console()
    table = Table(title=f"{len(rows)} records ({', '.join(p.name for p in files)})")
    for col in ("queue", "index", "type", "uid", "released_version", "step", "scores"):
        table.add_column(col)
    for row in rows[: args.limit]:
        scores = row.get("scores")
        table.add_row(
            str(row.get("queue")),
            str(row.get("index")),
            str(row.get("type", row.get("error", ""))),
            str(row.get("uid", "")),
            str(row.get("released_version", "")),
            str(row.get("step", "")),
            ", ".join(f"{s:.2f}" for s in scores) if scores else "",
        )
    console.print(table)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        console.print(f"wrote {len(rows)} rows to {args.jsonl}")
    if args.parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), args.parquet)
        console.print(f"wrote {len(rows)} rows to {args.parquet}")
    return 0
