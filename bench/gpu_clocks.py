"""The GPU's SM clock, power draw and clock-limit reasons while a bench runs.

A thread samples NVML (nvidia-ml-py's `pynvml`) every `interval_s`; `per_step` assigns the
samples to device-timed steps. An H200 under sustained load holds its 700 W cap by lowering
the SM clock (1410-1815 MHz against 1980 in the learner bench at b6c031c), so a step's
seconds mean little without the clock it ran at.

The device is found by its UUID: NVML numbers GPUs without regard to CUDA_VISIBLE_DEVICES.
Where NVML or CUDA is missing (CPU runs), `ClockSampler.open` returns None.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pynvml
import torch

from pipeline.weights.group import device_key

# nvmlClocksEventReasons bits (the names nvidia-smi prints, shortened)
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


@dataclass(frozen=True)
class Sample:
    t: float  # host perf_counter seconds
    sm_mhz: int
    power_w: float
    reasons: int  # REASONS bits
    temp_c: int


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in REASONS.items() if bits & bit]


class _Nvml:
    """The few NVML calls the sampler makes, on one device."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        # renamed in newer drivers; an older driver exports only the old name
        self._reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons
        try:
            self._reasons(handle)
        except pynvml.NVMLError_FunctionNotFound:
            self._reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        except pynvml.NVMLError:
            pass

    @classmethod
    def open(cls, uuid: str) -> _Nvml | None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return None
        for name in (uuid, f"GPU-{uuid}"):
            try:
                return cls(pynvml.nvmlDeviceGetHandleByUUID(name))
            except pynvml.NVMLError:
                continue
        pynvml.nvmlShutdown()
        return None

    def read(self) -> Sample | None:
        """One sample, or None where NVML gave no SM clock; a power, reasons or temperature
        reading it refuses stays nan, 0 or -1."""
        try:
            clock = pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
        except pynvml.NVMLError:
            return None
        watts = float("nan")
        with contextlib.suppress(pynvml.NVMLError):
            watts = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3  # mW
        reasons = 0
        with contextlib.suppress(pynvml.NVMLError):
            reasons = self._reasons(self.handle)
        celsius = -1
        with contextlib.suppress(pynvml.NVMLError):
            celsius = pynvml.nvmlDeviceGetTemperature(self.handle, pynvml.NVML_TEMPERATURE_GPU)
        return Sample(time.perf_counter(), clock, watts, reasons, celsius)

    def close(self) -> None:
        pynvml.nvmlShutdown()


class ClockSampler:
    """Samples one GPU from a thread between `start` and `stop`; `close` also releases
    NVML."""

    def __init__(self, nvml: _Nvml, interval_s: float) -> None:
        self._nvml = nvml
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, device: torch.device, interval_s: float = 0.01) -> ClockSampler | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        nvml = _Nvml.open(device_key(device))
        return None if nvml is None else cls(nvml, interval_s)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._nvml.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self._nvml.read()
            if sample is not None:
                self.samples.append(sample)
            self._stop.wait(self.interval_s)


def per_step(samples: Sequence[Sample], t0: float, edges: Sequence[float]) -> list[dict[str, Any]]:
    """Each step's samples: step k ran from t0 + edges[k] to t0 + edges[k + 1] (host
    seconds; `edges` from the device's events, t0 the host time of the first). A step
    without a sample inside gets the nearest one. Per step: median and lowest SM MHz,
    mean W, the limit reasons seen, the number of samples."""
    times = [s.t for s in samples]  # in sampling order: ascending
    out = []
    for a, b in itertools.pairwise(edges):
        lo, hi = t0 + a, t0 + b
        inside = list(samples[bisect.bisect_left(times, lo) : bisect.bisect_left(times, hi)])
        if not inside and samples:
            mid = (lo + hi) / 2
            near = bisect.bisect_left(times, mid)
            around = samples[max(near - 1, 0) : near + 1]
            inside = [min(around, key=lambda s: abs(s.t - mid))]
        if not inside:
            out.append({})
            continue
        bits = 0
        for s in inside:
            bits |= s.reasons
        out.append(
            {
                "sm_mhz": statistics.median(s.sm_mhz for s in inside),
                "sm_mhz_min": min(s.sm_mhz for s in inside),
                "power_w": round(statistics.fmean(s.power_w for s in inside), 1),
                "temp_c": max(s.temp_c for s in inside),
                "reasons": reason_names(bits),
                "samples": len(inside),
            }
        )
    return out


def at_top_clock(
    seconds: Sequence[float], clocks: Sequence[dict[str, Any]], top_mhz: float
) -> list[float]:
    """The steps whose every sample ran at `top_mhz` or above."""
    return [s for s, c in zip(seconds, clocks, strict=True) if c and c["sm_mhz_min"] >= top_mhz]
