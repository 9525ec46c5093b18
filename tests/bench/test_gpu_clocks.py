"""The clock samples' assignment to device-timed steps, the learner bench's figures from
them, and the NVML readings (through pynvml; the real sampling is a `gpu` test)."""

from __future__ import annotations

import math
import time

import pynvml
import pytest
import torch
from bench.gpu_clocks import (
    ClockSampler,
    Sample,
    _Nvml,
    at_top_clock,
    per_step,
    reason_names,
)
from bench.learner_step import clock_figures


def sample(t: float, mhz: int, watts: float = 500.0, reasons: int = 0) -> Sample:
    return Sample(t=t, sm_mhz=mhz, power_w=watts, reasons=reasons, temp_c=60)


def test_steps_get_the_samples_inside_them_and_a_lone_step_its_nearest() -> None:
    t0 = 100.0
    samples = [
        sample(99.99, 1000),  # before the run: nobody's
        sample(100.001, 1980, 600.0),
        sample(100.030, 1980, 700.0),
        sample(100.055, 1500, 690.0, reasons=0x4),
        sample(100.300, 1700),  # after step 2 ends; the nearest to step 3's middle
    ]
    edges = [0.0, 0.050, 0.100, 0.120]  # three steps
    steps = per_step(samples, t0, edges)
    assert len(steps) == 3
    assert steps[0]["samples"] == 2 and steps[0]["sm_mhz"] == 1980
    assert steps[0]["power_w"] == 650.0 and steps[0]["reasons"] == []
    assert steps[1]["samples"] == 1 and steps[1]["sm_mhz_min"] == 1500
    assert steps[1]["reasons"] == ["sw_power_cap"]
    assert steps[2]["samples"] == 1 and steps[2]["sm_mhz"] == 1500  # 100.055 is nearer
    assert per_step([], t0, edges) == [{}, {}, {}]


def test_reason_bits_are_named() -> None:
    assert reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]
    assert reason_names(0) == []


def test_at_top_clock_keeps_steps_whose_every_sample_ran_at_it() -> None:
    seconds = [0.050, 0.055, 0.051, 0.060]
    clocks = [
        {"sm_mhz_min": 1980},
        {"sm_mhz_min": 1800},
        {"sm_mhz_min": 1980},
        {},  # no sample: not counted
    ]
    assert at_top_clock(seconds, clocks, 1980) == [0.050, 0.051]


def test_clock_figures_report_the_median_step_and_mfu_at_the_top_clock() -> None:
    systems = {
        "ours": {"consecutive": [0.050, 0.056, 0.052]},
        "hf": {"consecutive": [0.064, 0.065, 0.070]},
    }
    fast, slow = {"sm_mhz_min": 1980}, {"sm_mhz_min": 1600}
    clocks = {"ours": [fast, slow, fast], "hf": [slow, slow, slow]}
    out = clock_figures(systems, clocks, flops_per_token=3e9, tokens=8192, peak=989e12)
    assert out["clock_top_sm_mhz"] == 1980
    ours = out["at_top_clock"]["ours"]
    assert ours["steps"] == 2 and ours["of"] == 3 and ours["median_s"] == 0.051
    assert ours["mfu"] == round(3e9 * 8192 / 0.051 / 989e12, 4)
    assert "hf" not in out["at_top_clock"]  # never at the top clock
    assert clock_figures(systems, {"ours": [], "hf": []}, 3e9, 8192, 989e12) == {}


def test_no_sampler_on_cpu() -> None:
    assert ClockSampler.open(torch.device("cpu")) is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _driver_answers(monkeypatch: pytest.MonkeyPatch, refuse: tuple[str, ...] = ()) -> None:
    """pynvml's four readings as a driver answers them (the real ones need a GPU), or the
    NVMLError pynvml raises where the driver refuses one."""
    answers = {
        "nvmlDeviceGetClockInfo": ("clock", 1980),
        "nvmlDeviceGetPowerUsage": ("power", 690_500),  # mW
        "nvmlDeviceGetCurrentClocksEventReasons": ("reasons", 0x4),
        "nvmlDeviceGetTemperature": ("temp", 55),
    }
    for function, (name, value) in answers.items():

        def call(_handle, *_args, value=value, refused=name in refuse):
            if refused:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return value

        monkeypatch.setattr(pynvml, function, call)


def test_a_reading_keeps_what_nvml_gave_and_drops_a_sample_without_a_clock(monkeypatch) -> None:
    _driver_answers(monkeypatch)
    full = _Nvml(None).read()
    assert full is not None
    assert (full.sm_mhz, full.power_w, full.reasons, full.temp_c) == (1980, 690.5, 0x4, 55)
    _driver_answers(monkeypatch, refuse=("power", "reasons", "temp"))
    partial = _Nvml(None).read()
    assert partial is not None and partial.sm_mhz == 1980
    assert math.isnan(partial.power_w) and partial.reasons == 0 and partial.temp_c == -1
    _driver_answers(monkeypatch, refuse=("clock",))
    assert _Nvml(None).read() is None


def test_a_driver_without_clocks_event_reasons_is_read_by_the_old_name(monkeypatch) -> None:
    _driver_answers(monkeypatch)

    def missing(_handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", missing)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", lambda _h: 0x40)
    reading = _Nvml(None).read()
    assert reading is not None and reading.reasons == 0x40


def test_no_nvml_for_a_gpu_it_does_not_know() -> None:
    # here: no libnvidia-ml (CPU) or no such UUID (GPU host); either way no sampler
    assert _Nvml.open("00000000-0000-0000-0000-000000000000") is None


@pytest.mark.gpu
@needs_cuda
def test_the_sampler_reads_the_gpu_every_interval() -> None:
    sampler = ClockSampler.open(torch.device("cuda", torch.cuda.current_device()))
    assert sampler is not None
    sampler.start()
    time.sleep(0.3)
    sampler.close()
    samples = sampler.samples
    assert len(samples) >= 10  # every 10 ms
    assert [s.t for s in samples] == sorted(s.t for s in samples)
    assert all(s.sm_mhz > 0 and s.temp_c > 0 for s in samples)
    assert all(s.power_w > 0 for s in samples)
