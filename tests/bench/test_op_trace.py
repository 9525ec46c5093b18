"""op_trace: where two runs of one computation part, op by op."""

from __future__ import annotations

import torch

from pipeline.bench.op_trace import OpChecksums, first_divergence


def _block(x: torch.Tensor, shift: float) -> torch.Tensor:
    y = x * 2.0
    z = y + shift
    return torch.log(z).sum(dim=-1)


def _traced(x: torch.Tensor, shift: float) -> OpChecksums:
    with OpChecksums() as trace:
        _block(x, shift)
    return trace


def test_the_same_computation_does_not_part() -> None:
    x = torch.rand(8, 16) + 1.0
    report = first_divergence(_traced(x, 0.5), _traced(x, 0.5))
    assert report["ops"] == report["ops_again"] >= 4
    assert report["ops_differing"] == 0
    assert report["first_differing"] is None
    assert report["first_non_finite"] is None


def test_the_first_differing_op_is_named_with_its_checksums() -> None:
    """The multiply agrees; the add is the first op whose output differs, and every op
    after it differs too."""
    x = torch.rand(8, 16) + 1.0
    a, b = _traced(x, 0.5), _traced(x, 0.75)
    report = first_divergence(a, b)
    first = report["first_differing"]
    assert first is not None
    assert first["index"] == 1
    assert "add" in first["op"] and first["op"] == first["op_again"]
    assert first["checksums"] != first["checksums_again"]
    assert report["ops_differing"] == report["ops"] - 1
    assert report["first_non_finite"] is None


def test_the_first_non_finite_op() -> None:
    """A negative input to the log: NaN from the log on, reported at the log, and NaN
    compared with NaN counts as agreeing."""
    x = torch.rand(8, 16) + 1.0
    x[3, 4] = -5.0
    report = first_divergence(_traced(x, 0.5), _traced(x, 0.5))
    bad = report["first_non_finite"]
    assert bad is not None and "log" in bad["op"]
    assert "nan" in bad["checksums"]
    assert report["first_differing"] is None


def test_traces_of_different_lengths_part_where_one_ends() -> None:
    x = torch.rand(4, 4) + 1.0
    with OpChecksums() as longer:
        _block(x, 0.5)
        torch.exp(x)
    report = first_divergence(_traced(x, 0.5), longer)
    first = report["first_differing"]
    assert first is not None and first["index"] == report["ops"]
    assert first["op"] is None and "exp" in first["op_again"]
    assert report["ops_differing"] == 1


def test_allocations_are_not_checksummed() -> None:
    """An empty tensor holds whatever memory held: only what an op computes is compared."""
    with OpChecksums() as trace:
        buffer = torch.empty(64)
        buffer.fill_(1.0)
    assert [op.split()[0] for op in trace.ops] == ["aten.fill_.Scalar"]
    assert trace.table().tolist() == [[64.0, 64.0]]
