"""A deterministic, resumable walk over a prompt set, epoch after epoch.

Its whole state is four integers, so a checkpoint can store it and a restored run sees
exactly the prompts the interrupted run would have seen next, in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import msgspec

from pipeline.data.records import DataError

T = TypeVar("T")


class CursorState(msgspec.Struct, frozen=True):
    """Checkpointable position: `size` and `shuffle` guard against restoring onto other data."""

    seed: int
    epoch: int
    position: int
    size: int
    shuffle: bool = True


class PromptCursor(Generic[T]):
    """Yields items in a seeded per-epoch shuffled order, forever."""

    def __init__(
        self,
        items: Sequence[T],
        *,
        seed: int = 0,
        shuffle: bool = True,
        state: CursorState | None = None,
    ) -> None:
        if not items:
            raise DataError("prompt cursor needs at least one prompt")
        self._items = items
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: list[int] = self._order_for(0)
        if state is not None:
            self.restore(state)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self._items)))
        if self._shuffle:
            # An int seed: stable across processes (no hash randomisation) and Python versions.
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def epoch(self) -> int:
        """Completed passes over the data (0 during the first)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Items already taken in the current epoch."""
        return self._position

    def state(self) -> CursorState:
        """Where the cursor is; pass it to `restore` (or the constructor) to continue here."""
        return CursorState(self._seed, self._epoch, self._position, len(self._items), self._shuffle)

    def restore(self, state: CursorState) -> None:
        """Continue from `state`; refuses a state taken over a different prompt set."""
        if state.size != len(self._items):
            raise DataError(
                f"cursor state is for {state.size} prompts but this dataset has "
                f"{len(self._items)}; was the dataset changed since the checkpoint?"
            )
        if state.epoch < 0 or not 0 <= state.position <= state.size:
            raise DataError(f"cursor state out of range: {state}")
        self._seed, self._shuffle = state.seed, state.shuffle
        self._epoch, self._position = state.epoch, state.position
        self._order = self._order_for(self._epoch)

    def next(self) -> T:
        """The next item; a new epoch with a fresh order starts after the last one."""
        if self._position >= len(self._order):
            self._epoch += 1
            self._position = 0
            self._order = self._order_for(self._epoch)
        item = self._items[self._order[self._position]]
        self._position += 1
        return item

    def take(self, n: int) -> list[T]:
        """The next `n` items, crossing epoch boundaries as needed."""
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator[T]:
        while True:
            yield self.next()
