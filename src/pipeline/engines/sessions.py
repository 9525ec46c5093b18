"""Multi-turn sessions of the built-in engine: a finished turn's slot kept for the next one.

A request with a session (GenerationRequest.session) keeps its slot when its sample
finishes: the slot's KV cache holds every token of the sequence but the last sampled one.
The session's next request continues that sequence (the environment's tokens appended), is
admitted into the same slot and prefills only the tokens past the cached prefix. A weight
update marks kept caches stale under kv_on_update="recompute" (the next turn prefills the
whole sequence under the new weights); under "keep" they stay. When a new sample finds no
free slot, the least recently kept session is evicted: its next turn prefills from scratch
and says so (GenerationOutput.kv_evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Kept:
    slot: int
    # the sequence (prompt and output) once its output is collected; all but the last token
    # are in the cache
    tokens: list[int] | None = None
    stale: bool = False  # cached by weights since replaced (kv_on_update="recompute")

    def reusable(self, prompt: list[int]) -> int:
        """Leading tokens of `prompt` whose keys and values this slot holds; at least one
        token is always left to prefill (it gives the next token's logits)."""
        if self.stale or self.tokens is None:
            return 0
        n = min(len(self.tokens) - 1, len(prompt) - 1)
        if self.tokens[:n] == prompt[:n]:  # the usual case, compared in one C loop
            return n
        return next(i for i in range(n) if self.tokens[i] != prompt[i])


class Sessions:
    """Kept slots by session, least recently kept first."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._evicted: set[str] = set()
        self._ended: set[str] = set()  # released while a sample of theirs was in the engine
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, session: str, slot: int) -> bool:
        """A session's sample finished in `slot`: keep it, unless the session has ended
        (then the caller frees the slot)."""
        if session in self._ended:
            self._ended.discard(session)
            return False
        self._kept[session] = Kept(slot)
        return True

    def collected(self, session: str, tokens: list[int]) -> None:
        if (kept := self._kept.get(session)) is not None:
            kept.tokens = tokens

    def peek(self, session: str | None) -> Kept | None:
        return None if session is None else self._kept.get(session)

    def take(self, session: str) -> tuple[Kept | None, bool]:
        """The session's kept slot (None if it has none) and whether it was evicted."""
        evicted = session in self._evicted
        self._evicted.discard(session)
        return self._kept.pop(session, None), evicted

    def evict(self) -> int | None:
        """Free the least recently kept slot whose turn has been collected; its slot."""
        for session, kept in self._kept.items():
            if kept.tokens is not None:
                del self._kept[session]
                self._evicted.add(session)
                self.evictions += 1
                return kept.slot
        return None

    def release(self, session: str, *, in_flight: bool) -> int | None:
        """End a session: its kept slot to free, if it holds one. A sample of the session
        still in the engine (`in_flight`) frees its slot when it finishes."""
        self._evicted.discard(session)
        kept = self._kept.pop(session, None)
        if kept is None and in_flight:
            self._ended.add(session)
        return None if kept is None else kept.slot

    def mark_stale(self) -> None:
        for kept in self._kept.values():
            kept.stale = True
