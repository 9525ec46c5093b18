"""op_trace: where two runs of one computation part, op by op."""

from __future__ import annotations

import ctypes

import pytest
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
    assert first["inputs_differ"] is False  # the add itself made the difference
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
    assert trace.table().tolist() == [[0.0, 0.0, 64.0, 64.0]]  # fill_ reads no tensor


def test_a_write_outside_any_op_shows_as_inputs_that_differ() -> None:
    """A kernel launched outside the dispatcher (a plain Triton launch) is invisible to the
    trace: here a write through the output's raw pointer, as a kernel's. The next op is the
    first that differs, and it says that its inputs did."""

    def run(poke: bool) -> OpChecksums:
        x = torch.ones(8)
        with OpChecksums() as trace:
            y = x * 2.0
            if poke:
                ctypes.c_float.from_address(y.data_ptr() + 3 * y.element_size()).value = 7.0
            torch.exp(y)
        return trace

    report = first_divergence(run(False), run(True))
    first = report["first_differing"]
    assert first is not None and first["index"] == 1 and "exp" in first["op"]
    assert first["inputs_differ"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ops_that_move_tensors_between_devices_are_traced() -> None:
    """A copy to the host (the log-probs a forward hands back) has its inputs on the GPU
    and its output on the CPU; both sides of the trace's row, and the table, still form."""

    def moved(x: torch.Tensor) -> OpChecksums:
        with OpChecksums() as trace:
            host = (x * 2.0).cpu()
            (host.cuda() + 1.0).sum()
        return trace

    x = torch.rand(8, 16, device="cuda")
    a, b = moved(x), moved(x)
    assert a.table().shape == (len(a.ops), 4)
    report = first_divergence(a, b)
    assert report["ops"] >= 4
    assert report["ops_differing"] == 0


def test_a_view_of_memory_not_yet_written_is_not_checksummed() -> None:
    """A slice of a buffer that an op writes afterwards holds whatever the memory held
    (here NaN): a view computes nothing, so it is left out and nothing is non-finite."""
    buffer = torch.full((8,), float("nan"))  # stands for memory not yet written

    def fill() -> OpChecksums:
        with OpChecksums() as trace:
            head = buffer[:4]
            buffer.copy_(torch.ones(8))
            (head * 2.0).sum()
        return trace

    a = fill()
    buffer.fill_(float("nan"))
    report = first_divergence(a, fill())
    assert report["ops"] >= 2
    assert report["first_non_finite"] is None
    assert not any(op.startswith("aten.slice") for op in a.ops)
