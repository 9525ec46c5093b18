"""The clock samples' assignment to device-timed steps, and the learner bench's figures
from them (the NVML sampling itself needs a GPU: the learner bench on one exercises it)."""

from __future__ import annotations

import math

import torch

from pipeline.bench.gpu_clocks import ClockSampler, Sample, at_top_clock, per_step, reason_names
from pipeline.bench.learner_step import clock_figures


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


class _Driver:
    """NVML's four calls as a driver answers them (the real library needs a GPU): each
    writes its value through the pointer and returns 0, or returns `refuse[name]`."""

    CALLS = {
        "nvmlDeviceGetClockInfo": ("clock", 1980),
        "nvmlDeviceGetPowerUsage": ("power", 690_500),
        "nvmlDeviceGetCurrentClocksEventReasons": ("reasons", 0x4),
        "nvmlDeviceGetTemperature": ("temp", 55),
    }

    def __init__(self, refuse: dict[str, int]) -> None:
        for function, (name, value) in self.CALLS.items():
            setattr(self, function, self._call(refuse.get(name), value))

    @staticmethod
    def _call(refused: int | None, value: int):
        def call(_handle, *args):
            if refused is not None:
                return refused
            args[-1]._obj.value = value  # the ctypes.byref(...) argument
            return 0

        return call


def test_a_reading_keeps_what_nvml_gave_and_drops_a_sample_without_a_clock() -> None:
    from pipeline.bench.gpu_clocks import _Nvml

    full = _Nvml(_Driver({}), None).read()
    assert full is not None
    assert (full.sm_mhz, full.power_w, full.reasons, full.temp_c) == (1980, 690.5, 0x4, 55)
    partial = _Nvml(_Driver({"power": 3, "temp": 3}), None).read()
    assert partial is not None and partial.sm_mhz == 1980
    assert math.isnan(partial.power_w) and partial.temp_c == -1
    assert _Nvml(_Driver({"clock": 999}), None).read() is None
