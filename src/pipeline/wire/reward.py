"""Messages between the scorer and its reward worker process, and their framing.

msgspec msgpack over a socket pair, never pickle: a worker runs untrusted user code, and
nothing it sends back should be able to execute anything in the service. Frames are a 4-byte
big-endian length and a payload.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgspec

from pipeline.errors import PipelineError

MAX_FRAME_BYTES = 64 * 1024 * 1024
_HEADER = struct.Struct("!I")


class FrameError(PipelineError):
    """The worker's byte stream is broken (oversized frame, or closed mid-frame)."""


class WorkerHello(msgspec.Struct, tag="hello"):
    """Sent once by a started worker; `load_errors` maps a preloaded spec to why it failed."""

    pid: int
    load_errors: dict[str, str] = {}


class WorkerRequest(msgspec.Struct, tag="request"):
    """Score one sample with the reward `spec`; `seq` pairs it with its reply."""

    seq: int
    spec: str
    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict[str, Any] | None = None


class WorkerReply(msgspec.Struct, tag="reply"):
    """The score, or the reward's exception as text in `error` (then `score` is unused)."""

    seq: int
    score: float = 0.0
    error: str | None = None


WorkerMessage = WorkerHello | WorkerRequest | WorkerReply
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(WorkerMessage)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Write one frame; blocks until the kernel has taken all of it."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.settimeout(None)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, deadline: float | None = None) -> bytes | None:
    """Read one frame; None on a clean EOF, TimeoutError when `deadline` (monotonic) passes."""
    header = _recv_exact(sock, _HEADER.size, deadline, allow_eof=True)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"peer announced a frame of {size} bytes (limit {MAX_FRAME_BYTES})")
    body = _recv_exact(sock, size, deadline, allow_eof=False)
    assert body is not None
    return body


def _recv_exact(
    sock: socket.socket, size: int, deadline: float | None, *, allow_eof: bool
) -> bytes | None:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        if deadline is None:
            sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            if allow_eof and remaining == size:
                return None
            raise FrameError("peer closed the connection in the middle of a frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
