"""Random wire messages built from the struct definitions themselves.

The builders walk `msgspec.inspect` type info, so a field or message type added to
`pipeline.wire.messages` is covered by the round-trip and fuzz tests without editing them. One
builder serves both hypothesis (shrinkable draws) and seeded `random.Random` loops (fast
enough for ten thousand fuzz inputs) through the small `Picker` interface.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import msgspec.inspect as mi
import numpy as np
from hypothesis import strategies as st

from pipeline.wire.codec import ALLOWED_DTYPES, BF16, TensorPack
from pipeline.wire.messages import TensorRef

T = TypeVar("T")

# every dtype a tensor may travel as; bfloat16 rides as raw uint16 words
TENSOR_DTYPES: tuple[str, ...] = (*sorted(ALLOWED_DTYPES), BF16)
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what msgpack (and msgspec) can carry


class Picker(Protocol):
    """The random choices a builder needs; hypothesis and `random.Random` both provide them."""

    def integer(self, lo: int, hi: int) -> int: ...
    def floating(self) -> float: ...
    def text(self) -> str: ...
    def choice(self, options: Sequence[T]) -> T: ...
    def raw(self, n: int) -> bytes: ...


class HypothesisPicker:
    """Draws through hypothesis so failures shrink to a minimal message."""

    def __init__(self, draw: Any) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))

    def floating(self) -> float:
        # NaN never equals itself, so it cannot be checked by equality after a round trip
        return self._draw(st.floats(allow_nan=False))

    def text(self) -> str:
        return self._draw(st.text(max_size=12))

    def choice(self, options: Sequence[T]) -> T:
        return self._draw(st.sampled_from(options))

    def raw(self, n: int) -> bytes:
        return self._draw(st.binary(min_size=n, max_size=n))


_EDGE_INTS = (0, 1, -1, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, INT_MIN, INT_MAX)
_EDGE_FLOATS = (0.0, -0.0, 1.0, float("inf"), float("-inf"), sys.float_info.max, 5e-324)


class RandomPicker:
    """Seeded and cheap (microseconds per value), for loops of thousands of inputs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        r = self.rng.random()
        if r < 0.2:
            edges = [v for v in _EDGE_INTS if lo <= v <= hi]
            if edges:
                return self.rng.choice(edges)
        if r < 0.7:  # small values are what real messages hold
            return max(lo, min(hi, self.rng.randint(-3, 100)))
        bits = self.rng.randint(1, 64)
        return max(lo, min(hi, self.rng.randint(-(2**bits), 2**bits)))

    def floating(self) -> float:
        if self.rng.random() < 0.3:
            return self.rng.choice(_EDGE_FLOATS)
        return self.rng.uniform(-1e6, 1e6)

    def text(self) -> str:
        n = self.rng.randint(0, 10)
        chars = []
        for _ in range(n):
            cp = self.rng.choice((self.rng.randint(32, 126), self.rng.randint(0xA0, 0xD7FF)))
            chars.append(chr(cp))
        return "".join(chars)

    def choice(self, options: Sequence[T]) -> T:
        return self.rng.choice(options)

    def raw(self, n: int) -> bytes:
        return self.rng.randbytes(n)


def random_tensor(pick: Picker, dtype: str | None = None) -> np.ndarray:
    """A small C-contiguous array of `dtype` (uint16 words for bfloat16), random bytes."""
    name = dtype or pick.choice(TENSOR_DTYPES)
    np_dtype = np.dtype(np.uint16) if name == BF16 else np.dtype(name)
    shape = tuple(pick.integer(0, 4) for _ in range(pick.integer(0, 3)))
    count = int(np.prod(shape, dtype=np.int64))
    data = pick.raw(count * np_dtype.itemsize)
    if name == "bool":  # numpy bools are one byte holding 0 or 1
        data = bytes(b & 1 for b in data)
    return np.frombuffer(bytearray(data), dtype=np_dtype).reshape(shape)


def _value(t: mi.Type, pick: Picker, pack: TensorPack, depth: int) -> Any:
    if isinstance(t, mi.StructType):
        if t.cls is TensorRef:
            dtype = pick.choice(TENSOR_DTYPES)
            return pack.add(random_tensor(pick, dtype), dtype)
        return _struct(t, pick, pack, depth + 1)
    if isinstance(t, mi.UnionType):
        return _value(pick.choice(t.types), pick, pack, depth)
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.BoolType):
        return pick.choice((False, True))
    if isinstance(t, mi.IntType):
        return pick.integer(INT_MIN, INT_MAX)
    if isinstance(t, mi.FloatType):
        return pick.floating()
    if isinstance(t, mi.StrType):
        return pick.text()
    if isinstance(t, mi.BytesType):
        return pick.raw(pick.integer(0, 16))
    size = pick.integer(0, 3 if depth < 2 else 1)
    if isinstance(t, mi.ListType):
        return [_value(t.item_type, pick, pack, depth) for _ in range(size)]
    if isinstance(t, mi.VarTupleType):
        return tuple(_value(t.item_type, pick, pack, depth) for _ in range(size))
    if isinstance(t, mi.TupleType):
        return tuple(_value(item, pick, pack, depth) for item in t.item_types)
    if isinstance(t, mi.DictType):
        return {
            _value(t.key_type, pick, pack, depth): _value(t.value_type, pick, pack, depth)
            for _ in range(size)
        }
    raise NotImplementedError(f"no random values for {t!r}; teach msg_factories about it")


def _struct(info: mi.StructType, pick: Picker, pack: TensorPack, depth: int) -> Any:
    kwargs = {}
    for field in info.fields:
        # optional fields are left out now and then, so defaults (omitted on the wire) travel too
        if field.required or pick.choice((True, False)):
            kwargs[field.name] = _value(field.type, pick, pack, depth)
    return info.cls(**kwargs)


@functools.cache
def _type_info(cls: type) -> mi.StructType:
    return mi.type_info(cls)  # type: ignore[return-value]


def build_message(cls: type, pick: Picker) -> tuple[Any, TensorPack]:
    """A body of wire struct `cls` with random field values, and the tensors it references."""
    pack = TensorPack()
    body = _struct(_type_info(cls), pick, pack, 0)
    return body, pack


@st.composite
def messages(draw: Any, cls: type) -> tuple[Any, TensorPack]:
    """Hypothesis strategy of (body, tensors) for wire struct `cls`."""
    return build_message(cls, HypothesisPicker(draw))


def tensor_refs(obj: Any) -> list[TensorRef]:
    """Every `TensorRef` inside a body, nested structs and lists included."""
    if isinstance(obj, TensorRef):
        return [obj]
    if isinstance(obj, msgspec.Struct):
        return [r for f in obj.__struct_fields__ for r in tensor_refs(getattr(obj, f))]
    if isinstance(obj, list | tuple):
        return [r for item in obj for r in tensor_refs(item)]
    if isinstance(obj, dict):
        return [r for item in obj.values() for r in tensor_refs(item)]
    return []
