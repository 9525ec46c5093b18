from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.cursor import CursorState, PromptCursor
from pipeline.data.records import DataError

ITEMS = [f"p{i}" for i in range(10)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    cursor = PromptCursor(ITEMS, seed=1)
    first, second = cursor.take(10), cursor.take(10)
    assert sorted(first) == sorted(second) == sorted(ITEMS)
    assert first != second
    assert cursor.epoch == 1 and cursor.position == 10


def test_same_seed_same_order_other_seed_other_order():
    assert PromptCursor(ITEMS, seed=3).take(25) == PromptCursor(ITEMS, seed=3).take(25)
    assert PromptCursor(ITEMS, seed=3).take(25) != PromptCursor(ITEMS, seed=4).take(25)
    assert PromptCursor(ITEMS, shuffle=False).take(12) == ITEMS + ITEMS[:2]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), consumed=st.integers(0, 35), shuffle=st.booleans())
def test_checkpoint_restore_continues_exactly(seed, consumed, shuffle):
    original = PromptCursor(ITEMS, seed=seed, shuffle=shuffle)
    original.take(consumed)
    saved = msgspec.msgpack.encode(original.state())
    expected = original.take(23)

    state = msgspec.msgpack.decode(saved, type=CursorState)
    restored = PromptCursor(ITEMS, seed=999, state=state)  # the state's seed wins
    assert restored.take(23) == expected
    assert restored.state() == original.state()


def test_restore_refuses_another_dataset_and_bad_states():
    state = PromptCursor(ITEMS).state()
    with pytest.raises(DataError, match="for 10 prompts but this dataset has 9"):
        PromptCursor(ITEMS[:9], state=state)
    with pytest.raises(DataError, match="out of range"):
        PromptCursor(ITEMS, state=CursorState(seed=0, epoch=0, position=11, size=10))
    with pytest.raises(DataError, match="at least one"):
        PromptCursor([])
