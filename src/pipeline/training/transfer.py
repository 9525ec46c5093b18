"""Host <-> device copies that never make the host wait for the device's queued work.

A device-to-host copy into pageable memory returns only once it is done, so the host would
wait for everything queued before it (the rest of a train step); into pinned memory it is
queued like a kernel, and torch's caching host allocator keeps the pinned block from reuse
until the copy has run. Host-to-device, the driver stages a small pageable copy and returns
at once, but a large one waits for the stream's queued work, while pinning a buffer for one
copy costs the host about as much as a pageable copy of a few MB; so only large buffers are
pinned (`PAGEABLE_MAX_BYTES`, measured: docs/performance.md). A pinned block's first allocation
(cudaHostAlloc) waits for the device too; the caching allocator reuses it afterwards.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAGEABLE_MAX_BYTES = 2 << 20  # larger host-to-device copies are pinned first


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` on `device`, queued without waiting for the device (module docstring)."""
    if host.device == device:
        return host
    large = host.numel() * host.element_size() > PAGEABLE_MAX_BYTES
    if large and device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's copy to the host, queued now and read later with `wait`."""

    def __init__(self, source: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if source.device.type == "cuda":
            self.host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
            self.host.copy_(source, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = source.detach().to("cpu")

    def ready(self) -> bool:
        """The copy has landed (no wait)."""
        return self._event is None or self._event.query()

    def wait(self) -> Tensor:
        """The host tensor, once the copy has landed (waits for the device up to it)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.host
