"""The GPUs' own figures from NVML, read at scrape time: utilization, memory used, temperature, power.

    stoker_gpu_utilization_ratio{gpu}      0..1, the share of the last sample period a kernel ran
    stoker_gpu_memory_used_bytes{gpu}      device memory in use, every process's
    stoker_gpu_temperature_celsius{gpu}    the die
    stoker_gpu_power_watts{gpu}            the board's draw (NVML reports milliwatts)

`gpu` is NVML's device index. A `prometheus_client` custom collector: nothing is polled between
scrapes, and each scrape asks NVML afresh. Where there is no NVML (the `gpu` extra's
`nvidia-ml-py` not installed, no driver) or no device, `register_gpu_metrics` registers nothing
and says why in the log: a CPU machine's `/metrics` simply has no `stoker_gpu_` series. A reading
one device does not support (power on some boards) leaves that one sample out; the others stay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("stoker.gpu_metrics")

# name → HELP; `_read` says how each is read from NVML
GPU_METRICS: dict[str, str] = {
    "stoker_gpu_utilization_ratio": "Share of the last sample period in which a kernel ran on the GPU (NVML).",
    "stoker_gpu_memory_used_bytes": "GPU memory in use, by every process (NVML).",
    "stoker_gpu_temperature_celsius": "GPU die temperature (NVML).",
    "stoker_gpu_power_watts": "GPU board power draw (NVML).",
}


def _read(nvml: Any, name: str, handle: Any) -> float:
    if name == "stoker_gpu_utilization_ratio":
        return nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    if name == "stoker_gpu_memory_used_bytes":
        return float(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    if name == "stoker_gpu_temperature_celsius":
        return float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    return nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts


class GpuCollector:
    """Reads every device NVML sees, at each scrape. `nvml` is the `pynvml` module (or a stand-in
    with the same functions), already initialised."""

    def __init__(self, nvml: Any, count: int) -> None:
        self._nvml = nvml
        self._count = count

    def describe(self) -> list:
        return []  # read nothing at registration; collect() tells the names

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {name: GaugeMetricFamily(name, help, labels=["gpu"]) for name, help in GPU_METRICS.items()}
        for index in range(self._count):
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as exc:  # pynvml's NVMLError and its kin: a device gone or lost
                log.debug("gpu %d: no handle: %s", index, exc)
                continue
            for name, family in families.items():
                try:
                    family.add_metric([str(index)], _read(self._nvml, name, handle))
                except Exception as exc:  # NVMLError_NotSupported and the like: leave it out
                    log.debug("gpu %d: %s not read: %s", index, name, exc)
        yield from families.values()


def register_gpu_metrics(registry: CollectorRegistry, nvml: Any = None) -> GpuCollector | None:
    """A `GpuCollector` on `registry`, or None (nothing registered) where NVML or a GPU is missing.
    `nvml` stands in for `pynvml` (tests); by default it is imported here."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            log.debug("no GPU metrics: nvidia-ml-py is not installed (the `gpu` extra)")
            return None
    try:
        nvml.nvmlInit()
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, …
        log.info("no GPU metrics: NVML is not available (%s)", exc)
        return None
    if count == 0:
        log.info("no GPU metrics: NVML sees no GPU")
        return None
    collector = GpuCollector(nvml, count)
    registry.register(collector)
    return collector
