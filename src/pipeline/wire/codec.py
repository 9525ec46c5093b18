"""Encoding and validated decoding of wire messages (torch-free).

Decoding is strict: anything malformed, oversized, of an unknown schema version or of a
type the queue does not carry raises `SchemaMismatch` with a reason; the caller logs it,
counts it and keeps serving.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import msgspec.inspect
import numpy as np

from pipeline.errors import SchemaMismatch
from pipeline.wire.messages import MESSAGE_TYPES, SCHEMA_VERSION, Header, MsgType, TensorRef

ALLOWED_DTYPES = frozenset(
    {"bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"}
)
# bfloat16 has no numpy dtype: it travels as raw uint16 words with this name
BF16 = "bfloat16"

_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
_body_encoder = msgspec.msgpack.Encoder()
_body_decoders = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_TYPES.items()}


@dataclass(frozen=True)
class Limits:
    """Per-channel size limits; a larger frame is refused before it is parsed."""

    # the largest message header accepted
    max_header_bytes: int = 4096
    # the largest message body accepted
    max_body_bytes: int = 16 * 1024 * 1024
    # the largest tensor frame accepted
    max_tensor_bytes: int = 4 * 1024 * 1024 * 1024
    # the most frames one message may have
    max_frames: int = 65536


@dataclass
class TensorPack:
    """Collects tensor buffers while a body is built; each `add` returns its `TensorRef`."""

    buffers: list[Any] = field(default_factory=list)

    def add(self, array: np.ndarray, dtype_name: str | None = None) -> TensorRef:
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        name = dtype_name or array.dtype.name
        if name not in ALLOWED_DTYPES and name != BF16:
            raise ValueError(f"dtype {name} cannot travel; use one of {sorted(ALLOWED_DTYPES)}")
        self.buffers.append(array)
        return TensorRef(
            dtype=name, shape=tuple(int(d) for d in array.shape), frame=len(self.buffers) + 1
        )


@dataclass
class Message:
    """A decoded message: header, typed body, and the raw frames its tensors live in."""

    header: Header
    body: Any
    frames: Sequence[Any]

    @property
    def type(self) -> MsgType:
        return MsgType(self.header.type)

    def tensor(self, ref: TensorRef) -> np.ndarray:
        """Zero-copy view of a tensor frame (read-only; copy before writing)."""
        buf = self.frames[ref.frame]
        data = memoryview(buf.buffer if hasattr(buf, "buffer") else buf)
        dtype = np.uint16 if ref.dtype == BF16 else np.dtype(ref.dtype)
        return np.frombuffer(data, dtype=dtype).reshape(ref.shape)


def encode(
    body: Any, *, run_id: str, sender: str, seq: int, tensors: TensorPack | None = None
) -> list[Any]:
    header = Header(
        version=SCHEMA_VERSION,
        type=int(body.TYPE),
        run_id=run_id,
        sender=sender,
        seq=seq,
        sent_at=time.time(),
    )
    frames: list[Any] = [_header_encoder.encode(header), _body_encoder.encode(body)]
    if tensors is not None:
        frames.extend(tensors.buffers)
    return frames


def _frame_len(frame: Any) -> int:
    """Bytes in a frame: zmq.Frame, bytes, or any buffer (numpy arrays count bytes, not rows)."""
    if hasattr(frame, "buffer"):  # zmq.Frame
        return frame.buffer.nbytes
    if isinstance(frame, bytes | bytearray):
        return len(frame)
    return memoryview(frame).nbytes


def _frame_bytes(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _iter_refs(obj: Any) -> list[TensorRef]:
    """Every TensorRef in a decoded body: Struct fields whose declared type can hold one
    (`_ref_fields`), and list / tuple items below them. A WeightMeta's 290 entries (0.5B
    model) are not walked at all: that walk took most of a decode's time."""
    refs: list[TensorRef] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, TensorRef):
            refs.append(item)
        elif isinstance(item, msgspec.Struct):
            stack.extend(getattr(item, f) for f in _ref_fields(type(item)))
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return refs


@functools.cache
def _ref_fields(cls: type) -> tuple[str, ...]:
    """The fields of Struct type `cls` whose declared type can hold a TensorRef."""
    info = cast(msgspec.inspect.StructType, msgspec.inspect.type_info(cls))
    return tuple(f.name for f in info.fields if _can_hold_ref(f.type, set()))


def _can_hold_ref(t: msgspec.inspect.Type, seen: set[type]) -> bool:
    """Whether a value of declared type `t` can hold a TensorRef where `_iter_refs` looks
    (Struct fields, list and tuple items); `Any` can. `seen`: the Struct types whose fields
    this path is inside (a cycle back to one adds no ref: it holds one only through another
    field, which that type's own check sees). Other types (numbers, strings,
    dicts, ...) are not walked, so they hold none."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        if t.cls is TensorRef:
            return True
        if t.cls in seen:
            return False
        return any(_can_hold_ref(f.type, seen | {t.cls}) for f in t.fields)
    if isinstance(t, mi.ListType | mi.VarTupleType):
        return _can_hold_ref(t.item_type, seen)
    if isinstance(t, mi.TupleType):
        return any(_can_hold_ref(item, seen) for item in t.item_types)
    if isinstance(t, mi.UnionType):
        return any(_can_hold_ref(member, seen) for member in t.types)
    if isinstance(t, mi.NamedTupleType):
        return any(_can_hold_ref(f.type, seen) for f in t.fields)
    if isinstance(t, mi.Metadata):  # Annotated[...] with constraints
        return _can_hold_ref(t.type, seen)
    return isinstance(t, mi.AnyType | mi.CustomType)


def _check_tensor(ref: TensorRef, frames: Sequence[Any], limits: Limits) -> None:
    if ref.frame < 2 or ref.frame >= len(frames):
        raise SchemaMismatch("bad_tensor_ref", f"frame {ref.frame} of {len(frames)}")
    if ref.dtype not in ALLOWED_DTYPES and ref.dtype != BF16:
        raise SchemaMismatch("bad_dtype", f"dtype {ref.dtype!r} is not allowed")
    if any(d < 0 or d > limits.max_tensor_bytes for d in ref.shape):
        raise SchemaMismatch("bad_shape", f"dimension out of range in {ref.shape}")
    itemsize = 2 if ref.dtype == BF16 else np.dtype(ref.dtype).itemsize
    expected = math.prod(ref.shape) * itemsize
    got = _frame_len(frames[ref.frame])
    if expected != got:
        raise SchemaMismatch(
            "bad_tensor_size", f"{ref.dtype}{list(ref.shape)} needs {expected} bytes, got {got}"
        )


def decode(
    frames: Sequence[Any],
    *,
    allowed: frozenset[MsgType] | None = None,
    limits: Limits = Limits(),
    run_id: str | None = None,
) -> Message:
    """Validate and decode a multipart message; raise `SchemaMismatch` on anything off."""
    if len(frames) < 2:
        raise SchemaMismatch("malformed", f"expected >= 2 frames, got {len(frames)}")
    if len(frames) > limits.max_frames:
        raise SchemaMismatch("oversized", f"{len(frames)} frames > {limits.max_frames}")
    if _frame_len(frames[0]) > limits.max_header_bytes:
        raise SchemaMismatch("oversized", f"header of {_frame_len(frames[0])} bytes")
    if _frame_len(frames[1]) > limits.max_body_bytes:
        raise SchemaMismatch(
            "oversized", f"body of {_frame_len(frames[1])} bytes > {limits.max_body_bytes}"
        )
    for frame in frames[2:]:
        if _frame_len(frame) > limits.max_tensor_bytes:
            raise SchemaMismatch("oversized", f"tensor frame of {_frame_len(frame)} bytes")
    try:
        header = _header_decoder.decode(_frame_bytes(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise SchemaMismatch("malformed", f"header: {exc}") from None
    if header.version != SCHEMA_VERSION:
        raise SchemaMismatch(
            "unknown_version",
            f"schema version {header.version} (this build speaks {SCHEMA_VERSION}); "
            "run the same pipeline version on every service",
        )
    try:
        msg_type = MsgType(header.type)
    except ValueError:
        raise SchemaMismatch("unknown_type", f"type tag {header.type}") from None
    if allowed is not None and msg_type not in allowed:
        names = sorted(t.name for t in allowed)
        raise SchemaMismatch("wrong_type", f"{msg_type.name} on a channel that carries {names}")
    if run_id is not None and header.run_id != run_id:  # an empty one too
        raise SchemaMismatch("wrong_run", f"run id {header.run_id!r}, expected {run_id!r}")
    try:
        body = _body_decoders[msg_type].decode(_frame_bytes(frames[1]))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise SchemaMismatch("malformed", f"{msg_type.name} body: {exc}") from None
    for ref in _iter_refs(body):
        _check_tensor(ref, frames, limits)
    return Message(header=header, body=body, frames=frames)
