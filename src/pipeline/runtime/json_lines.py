"""Append-only JSON-lines files that survive a kill mid-write: the controller's journal,
the critic's record of its batched forwards.

A process killed while writing leaves half a line at the end. A reader leaves out a last
line without its newline; a writer cuts it before its first append, so the next record
starts on a line of its own and the file stays readable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class DamagedLine(ValueError):
    """A complete line (not the cut-short last one) that is not JSON."""

    def __init__(self, number: int, error: ValueError) -> None:
        super().__init__(f"line {number}: {error}")
        self.number, self.error = number, error


class JsonLines:
    """Appends one JSON object a line; with `durable`, each line is fsynced before
    `append` returns (and a new file's directory entry with it)."""

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path, self.durable = path, durable
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        drop_torn_tail(path)
        self._file = open(path, "ab")  # noqa: SIM115 - lives as long as its writer
        if new and durable:  # the directory entry must survive too
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_json_lines(path: Path) -> list[Any]:
    """The records of the file's complete lines (none without the file); DamagedLine for
    a complete line that is not JSON."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_bytes().split(b"\n")[:-1], 1):
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise DamagedLine(number, exc) from exc
    return records


def drop_torn_tail(path: Path) -> None:
    """Cut a half-written last line so the next record starts on a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def complete_lines(path: Path) -> int:
    """Whole lines in a JSON-lines file, after cutting a half-written last one."""
    if not path.exists():
        return 0
    drop_torn_tail(path)
    return path.read_bytes().count(b"\n")
