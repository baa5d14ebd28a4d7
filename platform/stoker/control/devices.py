"""What a deploy asks of devices, checked before anything starts: more GPUs per instance than any
one instance could ever be given here, or settings that shared devices decide themselves."""

from __future__ import annotations

from typing import Any

from stoker.errors import invalid
from stoker.spec.engine import settings_of
from warm_pool.backends.base import Backend
from warm_pool.launch import GpuInventory


async def check_devices(
    fields: dict[str, Any], cpu_build: bool, *, shared: bool, backend: Backend, gpus: GpuInventory
) -> None:
    """Refuse at deploy what no instance could ever be given: more GPUs than the backend has on
    one node (or this machine has), or settings a shared device decides (`--share-gpus`)."""
    engine = fields["engine"]
    n = settings_of(fields).devices(engine, cpu_build=cpu_build)
    if n and shared:
        if n > 1:
            raise invalid(
                f"'gpus' must be at most 1 on shared devices (--share-gpus, --device-memory), got {n}.",
                "gpus",
            )
        if fields["gpu_memory_utilization"] is not None:
            raise invalid(
                "'gpu_memory_utilization' is the fleet's on shared devices: each instance gets its "
                "footprint's share (--share-gpus).",
                "gpu_memory_utilization",
            )
    if n == 0:
        return
    capacity = await backend.device_capacity()
    if capacity is None:
        capacity = len(gpus.gpus), "this machine's GPUs (STOKER_GPUS or CUDA_VISIBLE_DEVICES)"
    most, where = capacity
    if n > most:
        asked = "the engine's default of 1" if fields["gpus"] is None else str(n)
        raise invalid(
            f"'gpus': each instance of {fields['name']!r} asks for {asked} GPU(s), and at most {most} "
            f"can be given to one instance here ({where}).",
            "gpus",
        )
