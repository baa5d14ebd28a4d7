"""`stoker.node.gpu_metrics`: NVML's readings as `stoker_gpu_*` at scrape time, with a fake NVML module
(no GPU here): what each device's readings become, a reading a device does not support left out,
and nothing registered (and no error) without NVML or without a device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stoker.node.gpu_metrics import GPU_METRICS, register_gpu_metrics


class NVMLError(Exception):
    pass


def fake_nvml(devices: list[dict], *, init_error: Exception | None = None):
    """A stand-in for `pynvml`: each device a dict of util (%), used (bytes), temp (°C), power (mW);
    a missing key raises NVMLError as an unsupported reading does."""

    def reading(key):
        def read(handle, *args):
            value = devices[handle].get(key)
            if value is None:
                raise NVMLError("Not Supported")
            return value

        return read

    def init():
        if init_error is not None:
            raise init_error

    util, mem = reading("util"), reading("used")
    return SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=util(h), memory=0),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=mem(h), total=80 << 30, free=0),
        nvmlDeviceGetTemperature=reading("temp"),
        nvmlDeviceGetPowerUsage=reading("power"),
    )


def scrape(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels["gpu"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


H100 = {"util": 87, "used": 40 << 30, "temp": 61, "power": 312_500}
IDLE = {"util": 0, "used": 512 << 20, "temp": 33, "power": 61_000}


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (
            [H100],
            {
                ("stoker_gpu_utilization_ratio", "0"): 0.87,
                ("stoker_gpu_memory_used_bytes", "0"): float(40 << 30),
                ("stoker_gpu_temperature_celsius", "0"): 61.0,
                ("stoker_gpu_power_watts", "0"): 312.5,
            },
        ),
        (
            [IDLE, {**H100, "power": None}],  # the second board reports no power: that one is left out
            {
                ("stoker_gpu_utilization_ratio", "0"): 0.0,
                ("stoker_gpu_memory_used_bytes", "0"): float(512 << 20),
                ("stoker_gpu_temperature_celsius", "0"): 33.0,
                ("stoker_gpu_power_watts", "0"): 61.0,
                ("stoker_gpu_utilization_ratio", "1"): 0.87,
                ("stoker_gpu_memory_used_bytes", "1"): float(40 << 30),
                ("stoker_gpu_temperature_celsius", "1"): 61.0,
            },
        ),
    ],
)
def test_each_device_reading_becomes_a_sample(devices, expected):
    registry = CollectorRegistry()
    assert register_gpu_metrics(registry, fake_nvml(devices)) is not None
    assert scrape(registry) == expected
    assert {name for name, _ in expected} <= set(GPU_METRICS)


def test_readings_are_taken_at_each_scrape():
    devices = [dict(H100)]
    registry = CollectorRegistry()
    register_gpu_metrics(registry, fake_nvml(devices))
    assert scrape(registry)[("stoker_gpu_temperature_celsius", "0")] == 61.0
    devices[0]["temp"] = 70
    assert scrape(registry)[("stoker_gpu_temperature_celsius", "0")] == 70.0


@pytest.mark.parametrize(
    "nvml",
    [
        fake_nvml([H100], init_error=NVMLError("NVML Shared Library Not Found")),
        fake_nvml([H100], init_error=NVMLError("Driver Not Loaded")),
        fake_nvml([]),  # NVML works, no GPU
    ],
)
def test_nothing_is_registered_without_nvml_or_a_gpu(nvml):
    registry = CollectorRegistry()
    assert register_gpu_metrics(registry, nvml) is None
    assert generate_latest(registry) == b""


def test_without_the_package_nothing_is_registered(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    registry = CollectorRegistry()
    assert register_gpu_metrics(registry) is None
    assert generate_latest(registry) == b""
