"""Device-to-host copies that leave the stream running, for the engine's one-step lag.

On CUDA a `.tolist()` waits for every kernel queued before it, so reading a step's finished
flags right after launching it leaves the GPU idle while Python prepares the next step. The
engine instead copies the flags into pinned host memory with non_blocking=True, records an
event, and reads them one step later, after the next step is queued. On CPU the copy is the
tensor itself and waiting is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostCopy:
    """Host tensors that are complete once `wait()` returns."""

    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None = None

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


def copy_to_host(*tensors: torch.Tensor) -> HostCopy:
    """Start copying `tensors` to host memory; the copies are valid after `wait()`.

    The tensors must not be written on the device before the copy has run (callers pass
    fresh results of a gather or a concatenation)."""
    if all(t.device.type == "cpu" for t in tensors):
        return HostCopy(list(tensors))
    host = []
    for t in tensors:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        host.append(out)
    event = torch.cuda.Event()
    event.record()
    return HostCopy(host, event)
