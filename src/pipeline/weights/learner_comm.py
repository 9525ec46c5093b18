"""Tiny collectives that keep every learner rank on the same path through a publish.

Only rank 0 talks to engines, yet every rank joins the FSDP gathers; so rank 0 shares its
decisions (rebuild or not, go or abort, the final outcome) and ranks agree on failures
before anyone leaves the bucket loop. Without this a single rank raising would leave the
others blocked in an all_gather until the FSDP timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LearnerComm:
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world = dist.get_world_size(group) if self.enabled else 1
        self.device = torch.device("cpu")
        if self.enabled and "nccl" in str(dist.get_backend(group)):
            self.device = torch.device("cuda", torch.cuda.current_device())

    def bcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's values on every rank (other ranks pass placeholders of the same length)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, group_src=0, group=self.group)
        return [int(v) for v in t.tolist()]

    def bcast_text(self, text: str) -> str:
        """Rank 0's text on every rank."""
        if self.world == 1:
            return text
        data = text.encode() if self.rank == 0 else b""
        (n,) = self.bcast_ints([len(data)])
        if n == 0:
            return ""
        buf = torch.zeros(n, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, group_src=0, group=self.group)
        return bytes(buf.cpu().numpy()).decode()

    def any_true(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())
