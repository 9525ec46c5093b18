"""Engine side: unpack received buckets into staging tensors (the engine's TP slice).

Staging tensors are allocated once per engine in its own dtype and shard shapes and reused
every sync; they are the engine's one staging copy of the weights, which the engine copies
into its serving weights at its safe point. The serving weights are untouched until the
whole update has landed, so any failure mid-way leaves the old version serving. A tensor
split across buckets is first assembled in a full-size byte buffer, then sliced when its
last chunk arrives.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pipeline.weights import tp
from pipeline.weights.gather import copy_pairs
from pipeline.weights.validate import Layout, ParamSpec


class Staging:
    def __init__(
        self,
        params: Mapping[str, ParamSpec],
        *,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.device = device
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tensors = {
            n: torch.empty(s.shape, dtype=s.dtype, device=device) for n, s in params.items()
        }
        self._assembly: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def land(self, layout: Layout, bucket: int, buf: torch.Tensor) -> None:
        """Unpack bucket `bucket` (a uint8 tensor of its size) into the staging tensors
        (whole tensors by one foreach copy; a split tensor's last chunk after its assembly)."""
        pairs = []
        for chunk in layout.by_bucket[bucket]:
            data = buf[chunk.offset : chunk.offset + chunk.nbytes]
            shape, dtype = layout.full[chunk.name]
            if chunk.start == 0 and chunk.last:
                full_bytes = data
            else:
                asm = self._assembly.get(chunk.name)
                if asm is None:
                    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
                    asm = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    self._assembly[chunk.name] = asm
                asm[chunk.start : chunk.start + chunk.nbytes].copy_(data)
                if not chunk.last:
                    continue
                full_bytes = asm
            full = full_bytes.view(dtype).view(shape)
            if not layout.resharded:  # full tensors: keep this rank's slice
                full = tp.shard(chunk.name, full, self.tp_rank, self.tp_size)
            pairs.append((self.tensors[chunk.name], full))
        copy_pairs(pairs)
