"""Recorded queues: an append-only file of length-prefixed multipart messages.

Layout: magic `PLQREC1\\n`, u32 header length, msgpack `RecordingHeader`; then records,
each `u64 total | u32 n_frames | f64 wall time | u64 len * n_frames | frame bytes`.
Every record is written with one `write` on an O_APPEND descriptor, so several consumer
replicas can append to the same queue file without interleaving. A truncated tail (a
process killed mid-write, or a length that runs past the end) stops the reading and is
reported (`QueueReader.truncated_at`), never misread; a damaged header or a record whose
frame lengths disagree with its total raises RecordingError with the offset.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pipeline.errors import RecordingError
from pipeline.wire import codec
from pipeline.wire.messages import SCHEMA_VERSION

MAGIC = b"PLQREC1\n"
_REC = struct.Struct("<QId")
_LEN = struct.Struct("<Q")


class RecordingHeader(msgspec.Struct, gc=False):
    schema_version: int
    queue: str
    run_id: str
    created: float


def _frame_bytes(frame: Any) -> bytes | memoryview:
    if hasattr(frame, "buffer"):
        return frame.buffer
    if isinstance(frame, bytes | bytearray | memoryview):
        return frame
    return memoryview(frame).cast("B")


class QueueRecorder:
    def __init__(self, path: str | Path, *, queue: str, run_id: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = msgspec.msgpack.encode(
            RecordingHeader(
                schema_version=SCHEMA_VERSION, queue=queue, run_id=run_id, created=time.time()
            )
        )
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            os.write(fd, MAGIC + struct.pack("<I", len(header)) + header)
        except FileExistsError:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._fd: int | None = fd
        self.records = 0

    def write(self, frames: Sequence[Any]) -> None:
        if self._fd is None:
            return
        parts = [_frame_bytes(f) for f in frames]
        lengths = [len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts]
        head = _REC.pack(sum(lengths), len(parts), time.time()) + b"".join(
            _LEN.pack(n) for n in lengths
        )
        os.write(self._fd, b"".join([head, *parts]))
        self.records += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Record:
    index: int
    wall_time: float
    frames: list[bytes]
    offset: int = 0  # of the record in its file

    def decode(self) -> codec.Message:
        return codec.decode(self.frames)


class QueueReader:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.truncated_at: int | None = None  # offset of an incomplete last record
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise RecordingError(f"{self.path} is not a recorded queue (bad magic)")
            raw = f.read(4)
            if len(raw) < 4:
                raise RecordingError(f"{self.path}: the header is truncated (offset {len(MAGIC)})")
            (n,) = struct.unpack("<I", raw)
            if len(MAGIC) + 4 + n > self.size:
                raise RecordingError(
                    f"{self.path}: the header's length {n} runs past the end of the file"
                )
            try:
                self.header = msgspec.msgpack.decode(f.read(n), type=RecordingHeader)
            except msgspec.DecodeError as exc:
                raise RecordingError(f"{self.path}: the header is damaged ({exc})") from exc
            self._start = f.tell()
        if self.header.schema_version != SCHEMA_VERSION:
            raise RecordingError(
                f"{self.path} was recorded with schema version {self.header.schema_version}; "
                f"this build reads {SCHEMA_VERSION}"
            )

    @property
    def truncated(self) -> bool:
        return self.truncated_at is not None

    def __iter__(self) -> Iterator[Record]:
        with open(self.path, "rb") as f:
            f.seek(self._start)
            index = 0
            while True:
                offset = f.tell()
                head = f.read(_REC.size)
                if not head:
                    return
                left = self.size - offset - len(head)
                if len(head) < _REC.size:
                    self.truncated_at = offset
                    return
                total, n_frames, wall = _REC.unpack(head)
                # lengths are checked against what the file holds before anything is read:
                # a damaged one would otherwise allocate its size
                if _LEN.size * n_frames + total > left:
                    self.truncated_at = offset
                    return
                if n_frames == 0:
                    raise RecordingError(f"{self.path}: record {index} (offset {offset}) is empty")
                lens_raw = f.read(_LEN.size * n_frames)
                lengths = [_LEN.unpack_from(lens_raw, i * _LEN.size)[0] for i in range(n_frames)]
                if sum(lengths) != total:
                    raise RecordingError(
                        f"{self.path}: record {index} (offset {offset}): its frames' lengths "
                        f"sum to {sum(lengths)}, its total says {total}"
                    )
                body = f.read(total)
                frames, pos = [], 0
                for n in lengths:
                    frames.append(body[pos : pos + n])
                    pos += n
                yield Record(index=index, wall_time=wall, frames=frames, offset=offset)
                index += 1


def queue_path(run_dir: str | Path, queue: str) -> Path:
    return Path(run_dir) / "queues" / f"{queue}.log"
