"""Host <-> device copies that never make the host wait for the device's queued work.

From pageable host memory the CUDA driver performs a stream sync before a host-to-device
copy, and returns from a device-to-host copy only once it is done: the host would wait for
everything already queued (a whole forward, or the previous train step) before it could
queue more. Through pinned memory both copies are queued like kernels; torch's caching host
allocator keeps a pinned block from reuse until the copy that reads or fills it has run.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` on `device`, queued without waiting for the device (pinned first for CUDA)."""
    if host.device == device:
        return host
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
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
