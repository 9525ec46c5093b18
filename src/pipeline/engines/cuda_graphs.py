"""CUDA-graph replay of the decode forward for fixed (batch, kv_len) buckets.

A decode step of a small model is bound by kernel-launch overhead; replaying a captured graph
removes it. Graphs are captured lazily, one per bucket actually used, into one shared memory
pool (safe because replays never overlap and every graph's output tensor stays referenced).
Rows beyond the real batch are padding: position -1 writes to the cache's sink column of
slot 0, which is never read. Weight updates must copy into the parameters in place
(param.copy_), which the engine does, so captured graphs stay valid.
"""

from __future__ import annotations

import torch

from pipeline.log import get_logger
from pipeline.models import CausalLM, KVCache

_log = get_logger("engines.cuda_graphs")


def _buckets(limit: int, smallest: int) -> list[int]:
    out: list[int] = []
    size = smallest
    while size < limit:
        out.append(size)
        size *= 2
    out.append(limit)
    return out


class DecodeGraphs:
    """Captured decode forwards: logits (b, vocab) for ids/positions (b, 1) and slots (b,)."""

    def __init__(
        self, model: CausalLM, cache: KVCache, max_batch: int, *, min_kv_bucket: int = 256
    ) -> None:
        self.model = model
        self.cache = cache
        self.batch_buckets = _buckets(max_batch, 1)
        self.kv_buckets = _buckets(cache.max_seq_len, min(min_kv_bucket, cache.max_seq_len))
        device = cache.k.device
        self.ids = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
        self.positions = torch.full((max_batch, 1), -1, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _bucket(self, sizes: list[int], n: int) -> int:
        return next(size for size in sizes if size >= n)

    def _capture(self, batch: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions, slots = self.ids[:batch], self.positions[:batch], self.slots[:batch]
        self.positions.fill_(-1)  # warm-up writes go to the sink column only
        self.slots.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.forward_cached(ids, positions, slots, self.cache, kv_len=kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward_cached(ids, positions, slots, self.cache, kv_len=kv_len)
        _log.debug("captured decode graph", batch=batch, kv_len=kv_len)
        return graph, logits[:, 0]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        b = ids.shape[0]
        key = (self._bucket(self.batch_buckets, b), self._bucket(self.kv_buckets, kv_len))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, logits = self.graphs[key]
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.positions[b : key[0]].fill_(-1)
        self.slots[b : key[0]].zero_()
        graph.replay()
        return logits[:b]
