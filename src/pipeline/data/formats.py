"""Row files on disk: JSONL, JSON and parquet in, JSONL and parquet out.

pyarrow is optional for the project (only parquet needs it), so it is imported on use and its
absence is a clear error rather than an ImportError at startup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from pipeline.data.records import BadRowError, DataError

SUFFIXES = (".jsonl", ".json", ".parquet")


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError("parquet files need pyarrow: pip install pyarrow") from exc
    return pq


def read_rows(path: str | Path) -> list[Any]:
    """All rows of a dataset file, as Python objects (normally dicts), in file order."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            return _pyarrow_parquet().read_table(path).to_pylist()
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{path}: cannot read parquet: {exc}") from exc
    if suffix == ".jsonl":
        rows: list[Any] = []
        with path.open("rb") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(msgspec.json.decode(line))
                except msgspec.DecodeError as exc:
                    raise BadRowError(
                        str(path), len(rows), f"line {line_no} is not valid JSON: {exc}"
                    ) from exc
        return rows
    if suffix == ".json":
        try:
            data = msgspec.json.decode(path.read_bytes())
        except msgspec.DecodeError as exc:
            raise DataError(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json dataset must be a list of rows")
        return data
    raise DataError(f"{path}: unknown dataset format {suffix!r}; use one of {', '.join(SUFFIXES)}")


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows as `.jsonl` or `.parquet` (by suffix); parent directories are created."""
    path = Path(path)
    rows = [dict(r) for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("wb") as fh:
            for row in rows:
                fh.write(msgspec.json.encode(row) + b"\n")
    elif suffix == ".parquet":
        pq = _pyarrow_parquet()
        import pyarrow as pa

        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(
                f"{path}: rows cannot be stored as parquet, whose columns have one type each "
                f"(e.g. text and chat prompts, or text and numeric ground truths, mixed): {exc}"
            ) from exc
        pq.write_table(table, path)
    else:
        raise DataError(f"{path}: cannot write {suffix!r}; use .jsonl or .parquet")
    return path
