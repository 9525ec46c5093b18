"""Every wire message survives encode -> (ZeroMQ) -> decode with fields and tensor bytes intact.

Bodies are random values built from the struct definitions (`msg_factories`), so each
field of each type in `MESSAGE_TYPES` is exercised, with tensors of every dtype that may
travel (bfloat16 as raw uint16 words). The ZeroMQ leg sends every frame zero-copy, as the
queues do for large tensors, and decodes `zmq.Frame`s rather than bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msg_factories import TENSOR_DTYPES, messages, random_tensor, tensor_refs

from pipeline.wire.codec import BF16, Message, TensorPack, decode, encode
from pipeline.wire.messages import MESSAGE_TYPES, SCHEMA_VERSION, MsgType, Prompt

TYPES = [MESSAGE_TYPES[t] for t in sorted(MESSAGE_TYPES)]
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,  # no .hypothesis/ directory in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """An inproc PAIR whose sender passes every frame zero-copy, however small."""
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    tx.copy_threshold = 0
    rx.bind("inproc://roundtrip")
    tx.connect("inproc://roundtrip")
    yield tx, rx
    tx.close(linger=0)
    rx.close(linger=0)
    ctx.term()


def as_bytes(frames: list[Any]) -> list[Any]:
    """Flat byte views of encoded frames, zero-copy: what a receiver holds.

    In-memory round trips hand `decode` byte views of the very same buffers, as a
    receiver would hold them (`test_decode_accepts_encode_output_directly` covers the
    numpy frames themselves).
    """
    return [
        memoryview(f.reshape(-1).view(np.uint8)) if isinstance(f, np.ndarray) else f for f in frames
    ]


def _check(msg: Message, body: Any, pack: TensorPack, *, run_id: str, sender: str) -> None:
    assert msg.type == body.TYPE
    assert type(msg.body) is type(body)
    assert msg.body == body
    assert msg.header.version == SCHEMA_VERSION
    assert (msg.header.run_id, msg.header.sender, msg.header.seq) == (run_id, sender, 7)
    refs = tensor_refs(msg.body)
    assert len(refs) == len(pack.buffers)
    for ref in refs:
        original = pack.buffers[ref.frame - 2]
        got = msg.tensor(ref)
        assert got.dtype == (np.uint16 if ref.dtype == BF16 else np.dtype(ref.dtype))
        assert got.shape == ref.shape == original.shape
        assert got.tobytes() == original.tobytes()


def test_every_msg_type_has_its_struct() -> None:
    assert set(MESSAGE_TYPES) <= set(MsgType)
    for tag, cls in MESSAGE_TYPES.items():
        assert tag == cls.TYPE


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data(), run_id=st.text(max_size=8), sender=st.text(max_size=8))
def test_roundtrip_in_memory(cls: type, data: st.DataObject, run_id: str, sender: str) -> None:
    body, pack = data.draw(messages(cls))
    frames = encode(body, run_id=run_id, sender=sender, seq=7, tensors=pack)
    msg = decode(as_bytes(frames), allowed=frozenset({cls.TYPE}), run_id=run_id)
    _check(msg, body, pack, run_id=run_id, sender=sender)
    for ref in tensor_refs(msg.body):  # decoding views the sender's buffers, never copies
        original = pack.buffers[ref.frame - 2]
        assert original.nbytes == 0 or np.shares_memory(msg.tensor(ref), original)


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_roundtrip_over_zmq_zero_copy(
    cls: type, data: st.DataObject, pair: tuple[zmq.Socket, zmq.Socket]
) -> None:
    tx, rx = pair
    body, pack = data.draw(messages(cls))
    tx.send_multipart(encode(body, run_id="run", sender="s", seq=7, tensors=pack), copy=False)
    frames = rx.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    msg = decode(frames, allowed=frozenset({cls.TYPE}), run_id="run")
    _check(msg, body, pack, run_id="run", sender="s")
    for ref in tensor_refs(msg.body):  # a view of the received frame, not a private copy
        frame = np.frombuffer(frames[ref.frame].buffer, dtype=np.uint8)
        assert frame.nbytes == 0 or np.shares_memory(msg.tensor(ref), frame)


@pytest.mark.parametrize("dtype", TENSOR_DTYPES)
def test_large_tensor_of_every_dtype(dtype: str, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    """Above pyzmq's default copy threshold (64 KiB) frames really travel zero-copy."""
    tx, rx = pair
    np_dtype = np.uint16 if dtype == BF16 else np.dtype(dtype)
    rng = np.random.default_rng(abs(hash(dtype)) % 2**32)
    raw = rng.integers(0, 256, size=(300, 257 * np.dtype(np_dtype).itemsize), dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    array = raw.view(np_dtype)
    pack = TensorPack()
    body = Prompt(uid="big", prompt_ids=pack.add(array, dtype), n_samples=1)
    tx.send_multipart(encode(body, run_id="run", sender="s", seq=7, tensors=pack), copy=False)
    msg = decode(rx.recv_multipart(copy=False), allowed=frozenset({MsgType.PROMPT}))
    _check(msg, body, pack, run_id="run", sender="s")


def test_bfloat16_words_round_trip_to_the_same_floats() -> None:
    """bfloat16 is the top half of a float32: the words must come back bit-exact."""
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, 1e38, -1e-38, np.inf], dtype=np.float32)
    words = (values.view(np.uint32) >> 16).astype(np.uint16)
    pack = TensorPack()
    body = Prompt(uid="bf", prompt_ids=pack.add(words, BF16), n_samples=1)
    msg = decode(as_bytes(encode(body, run_id="r", sender="s", seq=1, tensors=pack)))
    ref = msg.body.prompt_ids
    assert ref.dtype == BF16
    back = (msg.tensor(ref).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back, (words.astype(np.uint32) << 16).view(np.float32))


def test_decode_accepts_encode_output_directly() -> None:
    """In-process hand-offs (tests, replay of live frames) decode what `encode` returned."""
    pack = TensorPack()
    body = Prompt(uid="p", prompt_ids=pack.add(np.arange(8, dtype=np.int32)), n_samples=1)
    msg = decode(encode(body, run_id="r", sender="s", seq=1, tensors=pack))
    assert msg.tensor(msg.body.prompt_ids).tolist() == list(range(8))


def test_random_tensor_covers_every_dtype() -> None:
    """The factory itself: each dtype name yields the numpy dtype the codec will view it as."""
    import random

    from msg_factories import RandomPicker

    pick = RandomPicker(random.Random(0))
    for dtype in TENSOR_DTYPES:
        arr = random_tensor(pick, dtype)
        assert arr.dtype == (np.uint16 if dtype == BF16 else np.dtype(dtype))
        assert arr.flags.c_contiguous
