"""Per-entry checksum for verify mode: cheap enough to run on every byte, on CPU or GPU.

A sum of little-endian int32 words (accumulated in int64) plus the trailing bytes, kept to
63 bits so it fits a msgpack int. It is a corruption check (torn buffers, wrong offsets,
reused slots), not a cryptographic hash; it runs on the device the bytes are on.
"""

from __future__ import annotations

import torch

_MASK = (1 << 63) - 1


def checksum(data: torch.Tensor) -> int:
    """Checksum of a 1-D uint8 tensor (any device)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"checksum takes a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    n = data.numel()
    head = n - n % 4
    total = 0
    if head:
        words = data[:head]
        if words.storage_offset() % 4:
            words = words.clone()  # an int32 view needs 4-byte alignment
        total += int(torch.sum(words.view(torch.int32), dtype=torch.int64).item())
    if head < n:
        total += int(torch.sum(data[head:], dtype=torch.int64).item())
    return total & _MASK
