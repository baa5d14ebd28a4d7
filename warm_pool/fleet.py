"""The live fleet: the devices every deployment's instances share, and the arbiter carried out.

`Devices` knows each device's memory: the GPUs' from NVML (`nvidia-ml-py`) where there are GPUs, or
one budget for the CPU engine (`stoker up --device-memory SIZE`), so the same logic runs, and is
tested, on machines without a GPU. An instance reserves its awake footprint (`Footprint`: the
snapshot's weights + a KV-cache budget) while it starts or serves, and a residual while it sleeps.

Every pool asks the `Fleet` before it applies a decision (`grant`): the fleet runs
`warm_pool.arbiter.arbitrate` over every registered pool's latest wish and instances, pokes the
pools it asks to give memory back (they put their least busy instance to sleep at their next tick,
draining it first), and grants the asking pool growth only into memory that is free now: a wake
that needs another deployment's instance asleep first waits (its requests stay held) until that
sleep has happened, when the fleet pokes every pool again (`changed`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

from warm_pool.arbiter import Device, Grant, Wish, arbitrate, fits_now
from warm_pool.census import Member
from warm_pool.errors import InvalidConfig

log = logging.getLogger("stoker.fleet")
CPU_DEVICE = "cpu0"
# What a sleeping instance keeps. The CPU engine, measured on SmolLM2-135M fp32 (540 MB of weights):
# RSS 1,351 MB awake after a request, 406 MB asleep (level 1 drops the weights and the KV cache),
# against 245 MB for a bare `import torch, transformers`: 160 MiB beyond the runtime every process
# pays anyway. vLLM on a GPU keeps its CUDA context, typically 0.5-1 GiB; nothing measured it here
# (no GPU was lent), so 768 MiB stands until a GPU session measures it.
ASLEEP_RESIDUAL = {"cpu": 160 << 20, "vllm": 768 << 20}


@dataclass(frozen=True)
class Footprint:
    awake: int  # bytes while STARTING or READY: weights + KV budget
    asleep: int  # bytes while SLEEPING


class Devices:
    """The devices instances share, each with the memory they may reserve."""

    def __init__(self, devices: Iterable[Device]) -> None:
        self.devices = tuple(devices)
        if len({d.id for d in self.devices}) != len(self.devices):
            raise InvalidConfig("devices", "device ids must be distinct")

    @classmethod
    def cpu_budget(cls, memory: int) -> Devices:
        if memory <= 0:
            raise InvalidConfig("device_memory", f"--device-memory must be more than 0, got {memory}")
        return cls([Device(CPU_DEVICE, memory)])

    @classmethod
    def from_nvml(cls, indices: Iterable[int]) -> Devices:
        """The GPUs' total memory, read with NVML (`nvidia-ml-py`)."""
        import pynvml

        pynvml.nvmlInit()
        try:
            return cls(
                Device(
                    f"gpu{i}", int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
                )
                for i in indices
            )
        finally:
            pynvml.nvmlShutdown()

    def memory(self, device: str) -> int:
        return next((d.memory for d in self.devices if d.id == device), 0)


class FleetMember(Protocol):
    """What the fleet needs of a pool."""

    name: str

    def fleet_wish(self) -> Wish | None: ...  # its latest, None before its first decision

    def fleet_members(self) -> list[Member]: ...

    def poke(self) -> None: ...


class Fleet:
    def __init__(self, devices: Devices, registry: CollectorRegistry | None = None) -> None:
        self.devices = devices
        self._pools: dict[str, FleetMember] = {}
        self._gauge = Gauge(
            "stoker_device_memory_bytes",
            "Device memory by state: reserved by awake (STARTING/READY) and asleep instances, and free",
            ["device", "state"],
            registry=registry,
        )

    def register(self, pool: FleetMember) -> None:
        self._pools[pool.name] = pool

    def forget(self, name: str) -> None:
        self._pools.pop(name, None)
        self.changed()

    def changed(self) -> None:
        """An instance moved (slept, stopped, started): memory may have come free. Every pool
        decides again; one waiting for room may now go ahead."""
        self._update_gauge()
        for pool in self._pools.values():
            pool.poke()

    def grant(self, name: str) -> Grant | None:
        """`name`'s grant, its growth limited to memory free now; None if it has made no wish."""
        wishes = [w for p in self._pools.values() if (w := p.fleet_wish()) is not None]
        members = [m for p in self._pools.values() for m in p.fleet_members()]
        grants = arbitrate(wishes, members, self.devices.devices)
        mine = grants.get(name)
        if mine is None:
            return None
        for other, g in grants.items():
            awake_now = sum(1 for m in members if m.deployment == other and m.awake)
            if other != name and g.ready < awake_now:
                log.info(
                    "fleet: %s gives memory back for %s (READY %d -> %d)", other, name, awake_now, g.ready
                )
                self._pools[other].poke()
        return self._now(name, mine, {w.deployment: w for w in wishes}, members)

    def _now(self, name: str, grant: Grant, wishes: Mapping[str, Wish], members: list[Member]) -> Grant:
        """The part of `grant`'s growth that fits the memory free now (`arbiter.fits_now`)."""
        used = _used(members, wishes)
        free = {d.id: d.memory - used.get(d.id, 0) for d in self.devices.devices}
        return fits_now(grant, [m for m in members if m.deployment == name], wishes[name], free)

    def _update_gauge(self) -> None:
        wishes = {w.deployment: w for p in self._pools.values() if (w := p.fleet_wish()) is not None}
        members = [m for p in self._pools.values() for m in p.fleet_members()]
        for device in self.devices.devices:
            awake = sum(_cost(m, wishes) for m in members if m.device == device.id and m.awake)
            asleep = sum(_cost(m, wishes) for m in members if m.device == device.id and not m.awake)
            self._gauge.labels(device.id, "awake").set(awake)
            self._gauge.labels(device.id, "asleep").set(asleep)
            self._gauge.labels(device.id, "free").set(device.memory - awake - asleep)


def _cost(m: Member, wishes: Mapping[str, Wish]) -> int:
    w = wishes.get(m.deployment)
    if w is None:
        return m.holds
    return w.awake_bytes if m.awake else w.asleep_bytes


def _used(members: list[Member], wishes: Mapping[str, Wish]) -> dict[str, int]:
    used: dict[str, int] = {}
    for m in members:
        used[m.device] = used.get(m.device, 0) + _cost(m, wishes)
    return used


def footprint(weights: int, kv: int, engine: str) -> Footprint:
    return Footprint(weights + kv, ASLEEP_RESIDUAL.get(engine, 0))
