"""Damaged recordings give a typed RecordingError with the offset, or a truncation the
reader reports, never a MemoryError, struct.error or msgspec error (issue 33, defect 5)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import RecordingError
from pipeline.wire import codec
from pipeline.wire.messages import Prompt
from pipeline.wire.recording import MAGIC, QueueReader, QueueRecorder


def _recording(path: Path, n: int = 4) -> list[int]:
    """`n` prompt records; the offset of each."""
    recorder = QueueRecorder(path, queue="prompts", run_id="r")
    for i in range(n):
        tensors = codec.TensorPack()
        ref = tensors.add(np.arange(5, dtype=np.int32))
        body = Prompt(uid=f"p{i}", prompt_ids=ref, n_samples=2)
        recorder.write(codec.encode(body, run_id="r", sender="t", seq=i, tensors=tensors))
    recorder.close()
    return [r.offset for r in QueueReader(path)]


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_an_intact_recording_reads_whole(tmp_path: Path):
    path = tmp_path / "q.log"
    offsets = _recording(path)
    reader = QueueReader(path)
    assert [r.decode().body.uid for r in reader] == ["p0", "p1", "p2", "p3"]
    assert not reader.truncated and offsets[0] > len(MAGIC)


def test_a_huge_record_length_is_a_truncation_not_an_allocation(tmp_path: Path):
    path = tmp_path / "q.log"
    offsets = _recording(path)
    _patch(path, offsets[2], struct.pack("<Q", 1 << 62))
    reader = QueueReader(path)
    assert [r.index for r in reader] == [0, 1] and reader.truncated_at == offsets[2]


def test_a_huge_frame_count_is_a_truncation(tmp_path: Path):
    path = tmp_path / "q.log"
    offsets = _recording(path)
    _patch(path, offsets[1] + 8, struct.pack("<I", 0xFFFFFFFF))
    reader = QueueReader(path)
    assert len(list(reader)) == 1 and reader.truncated_at == offsets[1]


def test_frame_lengths_that_disagree_with_the_total_raise_with_the_offset(tmp_path: Path):
    path = tmp_path / "q.log"
    offsets = _recording(path)
    _patch(path, offsets[1] + 20, struct.pack("<Q", 3))  # the first frame's length
    with pytest.raises(RecordingError, match=f"record 1 \\(offset {offsets[1]}\\)"):
        list(QueueReader(path))


def test_a_cut_file_is_reported_at_its_last_record(tmp_path: Path):
    path = tmp_path / "q.log"
    offsets = _recording(path)
    path.write_bytes(path.read_bytes()[: offsets[3] + 7])
    reader = QueueReader(path)
    assert len(list(reader)) == 3 and reader.truncated_at == offsets[3]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (MAGIC, "header is truncated"),
        (MAGIC + struct.pack("<I", 1000) + b"x", "runs past the end"),
        (MAGIC + struct.pack("<I", 3) + b"\xc1\xc1\xc1", "header is damaged"),
        (b"NOTAREC\n", "bad magic"),
    ],
)
def test_a_damaged_header_raises_a_recording_error(tmp_path: Path, content: bytes, reason: str):
    path = tmp_path / "q.log"
    path.write_bytes(content)
    with pytest.raises(RecordingError, match=reason):
        QueueReader(path)
