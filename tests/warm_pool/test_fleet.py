"""The live fleet's part beyond the arbiter (`warm_pool.fleet.Fleet`): growth only into memory free
now, victims poked, a waiting wake's sleeper kept, and the device gauge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from warm_pool.arbiter import Wish
from warm_pool.census import Member
from warm_pool.fleet import Devices, Fleet, Footprint
from warm_pool.fleet_seat import FleetSeat
from warm_pool.policies.base import Decision

MIB = 1 << 20


@dataclass
class Pool:
    name: str
    wish: Wish | None = None
    members: list[Member] = field(default_factory=list)
    pokes: int = 0

    def fleet_wish(self) -> Wish | None:
        return self.wish

    def fleet_members(self) -> list[Member]:
        return self.members

    def poke(self) -> None:
        self.pokes += 1


def wish(name: str, ready: int, sleeping: int = 0, held: int = 0) -> Wish:
    return Wish(name, ready, sleeping, 64 * MIB, 0, held=held)


def test_a_wake_waits_for_the_victim_to_sleep_and_keeps_its_sleeper():
    registry = CollectorRegistry()
    fleet = Fleet(Devices.cpu_budget(100 * MIB), registry)
    a = Pool("a", wish("a", 1), [Member("a-1", "a", "cpu0", True)])
    b = Pool("b", wish("b", 1, held=1), [Member("b-1", "b", "cpu0", False)])
    fleet.register(a)
    fleet.register(b)
    grant = fleet.grant("b")
    assert (grant.ready, grant.sleeping, grant.denied) == (0, 1, 1)  # not yet: a is still awake
    assert a.pokes == 1  # told to give its memory back
    a.members = [Member("a-1", "a", "cpu0", False)]  # a's instance fell asleep
    fleet.changed()
    assert b.pokes == 1
    grant = fleet.grant("b")
    assert (grant.ready, grant.sleeping, grant.denied) == (1, 0, 0)  # now the wake goes ahead
    b.members = [Member("b-1", "b", "cpu0", True)]
    fleet.changed()
    sample = registry.get_sample_value
    assert sample("stoker_device_memory_bytes", {"device": "cpu0", "state": "awake"}) == 64 * MIB
    assert sample("stoker_device_memory_bytes", {"device": "cpu0", "state": "free"}) == 36 * MIB


def test_a_fresh_start_goes_on_a_device_with_room_now():
    fleet = Fleet(Devices.cpu_budget(200 * MIB))
    a = Pool("a", wish("a", 1), [Member("a-1", "a", "cpu0", True, busy=True)])
    b = Pool("b", wish("b", 2, held=2))
    fleet.register(a)
    fleet.register(b)
    grant = fleet.grant("b")
    assert (grant.ready, grant.start_on, grant.denied) == (2, ("cpu0", "cpu0"), 0)
    c = Pool("c", wish("c", 1, held=1))
    fleet.register(c)
    b.members = [Member(f"b-{i}", "b", "cpu0", True, busy=True) for i in range(2)]
    assert fleet.grant("c").denied == 1  # everything there is busy: nothing to evict


@dataclass
class Load:
    queued: int = 0
    in_flight: int = 0
    last_arrival: float | None = None
    outstanding: dict = field(default_factory=dict)


def test_the_seat_dates_a_spell_of_held_requests_from_its_first_tick():
    """The arbiter serves the deployment held longest first (`Wish.held_since`); a live pool knows
    how many requests are held, not since when, so its seat dates them from the first tick that
    saw any, until none is held."""
    fleet = Fleet(Devices.cpu_budget(100 * MIB))
    seat = FleetSeat("a", fleet)
    fleet.register(Pool("a"))
    fleet._pools["a"].fleet_wish = lambda: seat.wish  # the pool's wish is its seat's
    footprint = Footprint(64 * MIB, 0)
    since = []
    for now, queued in ((1.0, 0), (5.0, 1), (6.0, 3), (7.0, 0), (8.0, 2)):
        seat.arbitrate(Decision(1), Load(queued), footprint, 1.0, now)
        since.append(seat.wish.held_since)
    assert since == [math.inf, 5.0, 5.0, math.inf, 8.0]
    seat.arbitrate(Decision(1), Load(1), footprint, 1.0)  # no clock given: undated, as before
    assert seat.wish.held_since == math.inf


async def test_a_vllm_instance_on_a_shared_gpu_takes_its_share_of_its_memory(tmp_path, tiny_model_dir):
    from snapshots import SnapshotStore, import_hf_dir
    from warm_pool.instances import InstanceOps, InstanceSettings
    from warm_pool.launch import GpuInventory
    from warm_pool.snapshot import SnapshotSource
    from warm_pool.states import Instance
    from warm_pool.vllm import VllmLaunch, VllmRuntime

    store = SnapshotStore(tmp_path / "store")
    source = SnapshotSource(store, import_hf_dir(tiny_model_dir, store).id)
    launch = VllmLaunch(VllmRuntime(("vllm",), "0.32.0"), ("--enforce-eager",))  # a GPU build
    settings = InstanceSettings("d", source, "vllm", 30.0, 8, 300.0, 10.0, "127.0.0.1", None, launch)
    ops = InstanceOps(settings, backend=None, engines=object(), gpus=GpuInventory([0, 1]))
    ops.share_of = lambda device: 0.25
    shared = Instance("d-00000001", "d", 0.0, 8, port=8001, device="gpu1", secret="k")
    spec = await ops._spec(shared, source.path)
    args = " ".join(spec.argv)
    assert "--gpu-memory-utilization 0.250 --enforce-eager" in args and "--enable-sleep-mode" in args
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1"
    alone = Instance("d-00000002", "d", 0.0, 8, port=8002, secret="k")  # no shared device: a whole GPU
    spec = await ops._spec(alone, source.path)
    assert "--gpu-memory-utilization" not in spec.argv and spec.env["CUDA_VISIBLE_DEVICES"] == "0"
