"""Checksums of every op's outputs, to find the first op whose result differs between two
runs of the same computation (the SM-share bench's `--trace`).

Each floating output of each op dispatched below autograd (views left out) is reduced on
its device to its sum and its L1 norm (float32 accumulation, no upcast copy), queued behind
the op without a host sync, so the device keeps its queue as in an untraced run; so are the
op's floating inputs, together, before it runs. Ops inside a compiled graph or a CUDA graph replay are not
dispatched one by one: trace an eager run (`compile = false`, `trunk_graphs = false`) to see
each kernel. A custom op (the RoPE, norm and SwiGLU kernels of models/) shows as one op; a
kernel launched outside any op (the log-prob statistics of models/logit_stats.py) shows as
the first op whose inputs differ while every earlier output agreed (`inputs_differ`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ATEN = torch.ops.aten
# ops whose outputs are allocated, not computed: their contents are whatever memory held
_UNINITIALISED = {
    _ATEN.empty,
    _ATEN.empty_like,
    _ATEN.empty_strided,
    _ATEN.new_empty,
    _ATEN.new_empty_strided,
    _ATEN.resize_,
}


class OpChecksums(TorchDispatchMode):
    """Records (op, output shape) and a (sum, L1) checksum for each floating output of each
    op that computes one (allocations left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self._sums: list[Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _UNINITIALISED or _is_view(func):
            return func(*args, **kwargs)
        inputs = _checksum(_read_only(func, args, kwargs))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if (row := _checksum([t])) is not None:
                # a copy between devices (.cpu()) has its inputs on one, its output on the other
                head = row * 0 if inputs is None else inputs.to(row.device)
                self._sums.append(torch.cat([head, row]))
                self.ops.append(f"{func} {tuple(t.shape)}")
        return out

    def table(self) -> Tensor:
        """(ops, 4) checksums on the host (this waits for the device): the inputs' sum and
        L1 norm, then the output's."""
        out = torch.zeros(len(self._sums), 4)
        rows: dict[torch.device, list[int]] = {}
        for i, sums in enumerate(self._sums):
            rows.setdefault(sums.device, []).append(i)
        for index in rows.values():  # one copy a device
            out[index] = torch.stack([self._sums[i] for i in index]).cpu()
        return out


def _is_view(func: Any) -> bool:
    """A view (slice, select, view...) computes nothing: its values are its base's, which
    may still be uninitialised memory that a later op writes."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _read_only(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The op's inputs it does not write (an in-place op's or an out= op's destination may
    hold uninitialised memory)."""
    written = {
        a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    }
    names = [a.name for a in func._schema.arguments]
    kept = [v for name, v in zip(names, args, strict=False) if name not in written]
    kept += [v for name, v in kwargs.items() if name not in written]
    return tree_leaves(kept)


def _checksum(leaves: list[Any]) -> Tensor | None:
    """(sum, L1) over the non-empty floating tensors among `leaves`, None without any."""
    tensors = [t.detach() for t in leaves if isinstance(t, Tensor) and t.is_floating_point()]
    rows = [
        torch.stack(
            [t.sum(dtype=torch.float32), torch.linalg.vector_norm(t, 1, dtype=torch.float32)]
        )
        for t in tensors
        if t.numel()
    ]
    if not rows:
        return None
    return rows[0] if len(rows) == 1 else torch.stack(rows).sum(0)


def _same(a: Tensor, b: Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def first_divergence(first: OpChecksums, again: OpChecksums) -> dict[str, Any]:
    """Where two traces of the same computation part: the first op whose checksums differ
    and the first op with a non-finite checksum in either (None where there is none), and
    how many ops differ in all. Traces that ran different ops part at the first of them."""
    a, b = first.table(), again.table()
    n = min(len(first.ops), len(again.ops))
    differ = [i for i in range(n) if first.ops[i] != again.ops[i] or not _same(a[i], b[i])]
    bad = [i for i in range(n) if not (bool(a[i].isfinite().all()) and bool(b[i].isfinite().all()))]

    if len(first.ops) != len(again.ops):
        differ.append(n)  # one trace ran ops the other did not

    def at(i: int) -> dict[str, Any]:
        def side(ops: list[str], sums: Tensor) -> tuple[str | None, list[float | str] | None]:
            if i >= len(ops):
                return None, None
            return ops[i], [_plain(x) for x in sums[i].tolist()]

        op, sums = side(first.ops, a)
        op_again, sums_again = side(again.ops, b)
        inputs_differ = None if sums is None or sums_again is None else sums[:2] != sums_again[:2]
        return {
            "index": i,
            "op": op,
            "op_again": op_again,
            "checksums": sums,
            "checksums_again": sums_again,
            # the op was handed different inputs: what wrote them ran outside any op
            "inputs_differ": inputs_differ,
        }

    return {
        "ops": len(first.ops),
        "ops_again": len(again.ops),
        "ops_differing": len(differ),
        "first_differing": at(differ[0]) if differ else None,
        "first_non_finite": at(bad[0]) if bad else None,
    }


def _plain(x: float) -> float | str:
    """A JSON-safe number: non-finite ones as text."""
    return x if math.isfinite(x) else str(x)
