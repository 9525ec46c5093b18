"""MetricSums: host numbers and tensors add into one reduced value per key."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.metrics import MetricSums


def test_host_numbers_cpu_tensors_and_device_tensors_sum_and_max_together():
    sums = MetricSums(["a", "b"], ["m"], torch.device("cpu"))
    sums.add("a", 1.5)  # a Python number: summed on the host
    sums.add("a", torch.tensor(2.0, dtype=torch.float64))  # a CPU tensor: host too
    sums.add("b", torch.tensor([3.0]).sum())
    sums.max("m", -4.0)
    sums.max("m", torch.tensor(-2.5))
    sums.max("m", -3.0)
    assert sums.reduce() == {"a": 3.5, "b": 3.0, "m": -2.5}


def test_device_tensors_add_into_their_own_entries(monkeypatch):
    """The on-device path (a GPU's tensors): each key's adds land in its entry of the one
    vector, the other entries untouched (CPU tensors taken as device tensors here)."""
    sums = MetricSums(["a", "b", "c"], ["m", "n"], torch.device("cpu"))
    monkeypatch.setattr(sums, "_on_device", lambda value: isinstance(value, torch.Tensor))
    sums.add("b", torch.tensor(2.0))
    sums.add("b", torch.tensor(0.5, dtype=torch.float32))
    sums.add("c", 1.0)  # a host number still goes to the host sums
    sums.max("n", torch.tensor(-1.0))
    sums.max("n", torch.tensor(-3.0))
    assert sums.reduce() == {"a": 0.0, "b": 2.5, "c": 1.0, "m": -float("inf"), "n": -1.0}


def test_undeclared_keys_are_errors():
    sums = MetricSums(["a"], [], torch.device("cpu"))
    with pytest.raises(KeyError, match="declared"):
        sums.add("b", 1.0)
    with pytest.raises(KeyError, match="max"):
        sums.max("a", 1.0)


def test_reduce_with_reads_extra_scalars_alongside_the_sums():
    sums = MetricSums(["a"], ["m"], torch.device("cpu"))
    sums.add("a", 2.0)
    sums.max("m", 1.0)
    extra = [
        torch.tensor(0.25),
        torch.tensor(True).float(),
        torch.tensor([7.0], dtype=torch.float16),
    ]
    values, got = sums.reduce_with(extra)
    assert values == {"a": 2.0, "m": 1.0}
    assert got == [0.25, 1.0, 7.0]
    assert sums.reduce_with([]) == ({"a": 2.0, "m": 1.0}, [])
