"""How an engine takes a finished update: at a safe point of its own loop.

The receiver thread calls `apply(tensors, version)` once every bucket landed. Copying into
the serving weights while a forward pass reads them would mix versions inside one step, so
`SafePointApply` only parks the update and returns a Future; the engine loop calls
`run_pending()` between steps. The Future protocol makes a timeout safe: if the receiver
gives up (apply phase timeout) it cancels the Future, and `set_running_or_notify_cancel`
then tells the engine loop not to apply it, so the old version keeps serving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import nn

# engine callback: (staging tensors by name, version) -> None when applied synchronously,
# or a Future resolved once applied. The tensors are reused by the next update: copy them.
ApplyFn = Callable[[dict[str, torch.Tensor], int], "Future[int] | None"]


def copy_into(module: nn.Module) -> Callable[[dict[str, torch.Tensor], int], None]:
    """An apply function that copies the update into `module`'s parameters by name."""
    params = dict(module.named_parameters())

    @torch.no_grad()
    def apply(tensors: dict[str, torch.Tensor], version: int) -> None:
        for name, value in tensors.items():
            params[name].copy_(value)

    return apply


class SafePointApply:
    """Parks each update until the engine loop reaches a safe point."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor], int], None]) -> None:
        self.fn = fn
        self._lock = threading.Lock()
        self._pending: tuple[Future[int], dict[str, torch.Tensor], int] | None = None

    def __call__(self, tensors: dict[str, torch.Tensor], version: int) -> Future[int]:
        future: Future[int] = Future()
        with self._lock:
            self._pending = (future, tensors, version)
        return future

    def run_pending(self) -> int | None:
        """Apply the parked update if any (engine loop, between steps); its version."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        future, tensors, version = pending
        if not future.set_running_or_notify_cancel():
            return None  # the receiver timed out and withdrew it
        try:
            self.fn(tensors, version)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.set_result(version)
        return version
