"""The fleet arbiter: which deployments' instances may be awake on which device, when their wishes
do not all fit. A pure function beside the policies (`arbitrate`), carried out by the live pools
(`warm_pool.fleet`) and by the fleet simulator alike.

Devices are memory. An awake instance (STARTING or READY) holds its awake footprint on its device
(weights + KV budget); a SLEEPING one a small residual (vLLM's CUDA context; the CPU engine's
asleep RSS). Each deployment's policy says how many it wants READY and SLEEPING (`Wish`); the
arbiter grants what fits (`Grant`):

1. Scale-down is always granted: fewer awake than now frees memory (the pool puts the least busy
   to sleep or stops them, draining their requests within the grace period first).
2. Growth (a wake, or a fresh start) is granted in order of the requester's value, highest first;
   among deployments with requests held (all worth `HELD_WORTH`) the one whose oldest held request
   arrived first goes first (`Wish.held_since`): first come, first served, not by name, which let
   the deployments early in the alphabet take every slot a start-up wave freed while a later one's
   request waited a minute and more. A wake must happen on the sleeper's own device (its process
   lives there). When it does not fit, the arbiter frees memory on that device by putting to sleep
   the awake instances worth least (then, if that is not enough, stopping the sleepers worth least)
   — never one with requests in flight, never one of the requester's own deployment, and never one
   worth as much as the requester or more, so two idle deployments do not evict each other back
   and forth. A fresh start goes to the device where it stops the fewest sleepers, then where it
   fits without evicting anything, then where it evicts the least worth, the freest of those
   (`_roomiest`). Fewest stops first: a sleeper put to sleep costs its next request a wake (~1 s),
   a sleeper stopped costs it a fresh start (20-28 s on a GPU), a slow cold start the arbiter
   caused. Two 40 GB instances awake fill an 80 GB device to the byte, so a start there stops
   every sleeper on it, where another device would only have put an idle instance to sleep
   (`bench/fleet_bench.py`'s eighth, 24 deployments on 3 devices: 244 slow cold starts with the
   held served first come, first served, 138 with the stops counted first as well).
3. A victim's deployment gets a grant one READY lower (and one SLEEPING higher when it was put to
   sleep): its own pool carries that out at its next tick.
4. The asking deployment's growth is then cut to what fits the memory free now (`fits_now`), before
   any eviction asked for has happened: the live fleet (`warm_pool.fleet`) and the fleet simulator
   (`warm_pool.fleet_sim`) call this one function, so neither ever exceeds a device's memory.

Worth, per byte held: expected requests in the next start-up horizon × the seconds each would
wait if the instance were not there (its wake time), over the bytes it holds awake. A deployment
with requests held right now is worth more than any forecast (`HELD_WORTH`): the request is not
expected, it is here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from warm_pool.census import Member

HELD_WORTH = math.inf


@dataclass(frozen=True)
class Device:
    id: str
    memory: int  # bytes instances may reserve on it


@dataclass(frozen=True)
class Wish:
    """One deployment's policy decision and what its instances cost and are worth."""

    deployment: str
    ready: int
    sleeping: int
    awake_bytes: int
    asleep_bytes: int
    rate: float = 0.0  # expected requests/s (the policy's forecast, else recent arrivals)
    horizon_s: float = 1.0  # the start-up horizon the value looks over (its wake time)
    held: int = 0  # requests held now, waiting for capacity
    held_since: float = math.inf  # when the oldest of them was held (one clock for the fleet)

    def worth(self) -> float:
        """Value per awake byte: expected requests over the horizon × the wait each would pay."""
        if self.held > 0:
            return HELD_WORTH
        return self.rate * self.horizon_s * self.horizon_s / max(1, self.awake_bytes)


@dataclass(frozen=True)
class Grant:
    ready: int
    sleeping: int
    start_on: tuple[str, ...] = ()  # a device for each fresh start granted, in order
    denied: int = 0  # awake instances wished for that did not fit


@dataclass
class _Device:
    device: Device
    used: int = 0

    @property
    def free(self) -> int:
        return self.device.memory - self.used


@dataclass
class _Plan:
    wishes: dict[str, Wish]
    devices: dict[str, _Device]
    awake: dict[str, list[Member]] = field(default_factory=dict)  # by deployment, as planned
    asleep: dict[str, list[Member]] = field(default_factory=dict)

    def cost(self, m: Member) -> int:
        w = self.wishes.get(m.deployment)
        if w is None:
            return m.holds
        return w.awake_bytes if m.awake else w.asleep_bytes


def arbitrate(
    wishes: Iterable[Wish], members: Iterable[Member], devices: Iterable[Device]
) -> dict[str, Grant]:
    """Every deployment's grant. Members of deployments with no wish hold their memory as they are
    (their pool is gone or has not decided yet)."""
    plan = _Plan({w.deployment: w for w in wishes}, {d.id: _Device(d) for d in devices})
    for m in members:
        (plan.awake if m.awake else plan.asleep).setdefault(m.deployment, []).append(m)
        if m.device in plan.devices:
            plan.devices[m.device].used += plan.cost(m)
    ready = {name: len(plan.awake.get(name, [])) for name in plan.wishes}
    sleeping = {name: len(plan.asleep.get(name, [])) for name in plan.wishes}
    start_on: dict[str, list[str]] = {name: [] for name in plan.wishes}
    denied = dict.fromkeys(plan.wishes, 0)
    evicted = dict.fromkeys(plan.wishes, 0)  # put to sleep to make room for another deployment

    # 1. Scale-down first: what it frees is there for the growth below.
    for name, w in plan.wishes.items():
        while ready[name] > w.ready:
            m = _least_busy(plan.awake[name])
            plan.awake[name].remove(m)
            plan.devices[m.device].used -= w.awake_bytes
            ready[name] -= 1
            if sleeping[name] < w.sleeping:
                plan.asleep.setdefault(name, []).append(Member(m.id, name, m.device, False))
                plan.devices[m.device].used += w.asleep_bytes
                sleeping[name] += 1
    # 2. Growth, most valuable first.
    for w in sorted(plan.wishes.values(), key=_growth_order):
        name = w.deployment
        while ready[name] < w.ready:
            sleeper = next(iter(plan.asleep.get(name, [])), None)
            if sleeper is not None:
                if not _make_room(
                    plan, sleeper.device, w.awake_bytes - w.asleep_bytes, w, ready, sleeping, evicted
                ):
                    denied[name] = w.ready - ready[name]
                    break
                plan.asleep[name].remove(sleeper)
                plan.awake.setdefault(name, []).append(Member(sleeper.id, name, sleeper.device, True))
                plan.devices[sleeper.device].used += w.awake_bytes - w.asleep_bytes
                sleeping[name] -= 1
            else:
                device = _roomiest(plan, w, ready, sleeping, evicted)
                if device is None:
                    denied[name] = w.ready - ready[name]
                    break
                plan.awake.setdefault(name, []).append(
                    Member(f"new-{name}-{ready[name]}", name, device, True)
                )
                plan.devices[device].used += w.awake_bytes
                start_on[name].append(device)
            ready[name] += 1
    # 3. Sleepers beyond what is wished (and what was put to sleep for others) are the pool's to stop.
    return {
        name: Grant(
            ready[name],
            # A sleeper whose wake was denied is kept: it is the one woken once there is room.
            min(sleeping[name], w.sleeping + evicted[name] + denied[name]),
            tuple(start_on[name]),
            denied[name],
        )
        for name, w in plan.wishes.items()
    }


def _growth_order(w: Wish) -> tuple[float, float, str]:
    """Most valuable first; among equals (every deployment with requests held) the one held
    longest first; then by name, so the order is total."""
    return (-w.worth(), w.held_since if w.held > 0 else math.inf, w.deployment)


def _least_busy(members: list[Member]) -> Member:
    return min(members, key=lambda m: (m.busy, m.id))


def _roomiest(
    plan: _Plan, w: Wish, ready: dict[str, int], sleeping: dict[str, int], evicted: dict[str, int]
) -> str | None:
    """The device a fresh start of `w` goes to: the one where it stops the fewest sleepers (each
    stop is a fresh start later for that sleeper's next request, where a sleep is a wake), then
    where it fits without evicting anything, then where it evicts the least worth, the freest of
    those."""
    options = []
    for dev in plan.devices.values():
        victims = _victims(plan, dev.device.id, w.awake_bytes, w)
        if victims is not None:
            stops = sum(1 for kind, _ in victims if kind == 1)
            lost = sum(plan.wishes[m.deployment].worth() for _, m in victims)
            options.append((stops, len(victims) > 0, lost, -dev.free, dev.device.id, victims))
    if not options:
        return None
    *_, device, victims = min(options, key=lambda o: o[:5])
    _evict(plan, device, victims, ready, sleeping, evicted)
    return device


def _make_room(
    plan: _Plan,
    device: str,
    needed: int,
    requester: Wish,
    ready: dict[str, int],
    sleeping: dict[str, int],
    evicted: dict[str, int],
) -> bool:
    """Free `needed` bytes on `device` (`_victims`); True if it then fits."""
    victims = _victims(plan, device, needed, requester)
    if victims is None:
        return False
    _evict(plan, device, victims, ready, sleeping, evicted)
    return True


def _victims(plan: _Plan, device: str, needed: int, requester: Wish) -> list[tuple[int, Member]] | None:
    """What to put to sleep (kind 0), then stop (kind 1), worth least first, to free `needed` bytes on
    `device`; [] if it fits as is; None if it cannot be made to fit (then nothing is evicted)."""
    dev = plan.devices.get(device)
    if dev is None:
        return None
    if dev.free >= needed:
        return []
    worth = requester.worth()
    candidates = []  # (kind, worth, member): sleep awake ones first, then stop sleepers
    for kind, groups in ((0, plan.awake), (1, plan.asleep)):
        for name, members in groups.items():
            w = plan.wishes.get(name)
            if w is None or name == requester.deployment or w.worth() >= worth:
                continue
            candidates += [(kind, w.worth(), m) for m in members if m.device == device and not m.busy]
    candidates.sort(key=lambda c: (c[0], c[1], c[2].id))
    freed, chosen = 0, []
    for kind, _, m in candidates:
        if dev.free + freed >= needed:
            break
        w = plan.wishes[m.deployment]
        freed += (w.awake_bytes - w.asleep_bytes) if kind == 0 else w.asleep_bytes
        chosen.append((kind, m))
    return chosen if dev.free + freed >= needed else None


def _evict(
    plan: _Plan,
    device: str,
    victims: list[tuple[int, Member]],
    ready: dict[str, int],
    sleeping: dict[str, int],
    evicted: dict[str, int],
) -> None:
    dev = plan.devices[device]
    for kind, m in victims:
        w = plan.wishes[m.deployment]
        if kind == 0:  # put to sleep
            plan.awake[m.deployment].remove(m)
            plan.asleep.setdefault(m.deployment, []).append(Member(m.id, m.deployment, m.device, False))
            dev.used -= w.awake_bytes - w.asleep_bytes
            ready[m.deployment] -= 1
            sleeping[m.deployment] += 1
            evicted[m.deployment] += 1
        else:  # stop
            plan.asleep[m.deployment].remove(m)
            dev.used -= w.asleep_bytes
            sleeping[m.deployment] -= 1


def fits_now(grant: Grant, mine: Sequence[Member], wish: Wish, free: Mapping[str, int]) -> Grant:
    """`grant`'s growth cut to what fits `free` (bytes free now on each device, in the devices' order),
    before any eviction it relies on has happened. `mine` are the asking deployment's members.

    Growth is counted from the members awake now. Sleepers are woken first, each on its own device,
    in the order `mine` lists them; a wake that does not fit waits, with every wake after it: those
    sleepers are kept asleep (SLEEPING raised by them, so the pool does not stop them), and woken
    at a later tick once there is room. Then fresh starts: on the grant's `start_on` devices, in
    order, else (none left) on the first device with room; one that fits nowhere waits. Worked
    example: grant READY 3 with 1 awake, 2 sleepers on a device with room for one wake → READY 2,
    SLEEPING + 1, denied + 1.

    Sleepers are checked in the order `mine` lists them: the live seat (`warm_pool.fleet_seat`) and
    the simulator both list them newest first (by creation), the one `warm_pool.plan` wakes, so the room
    checked is on the device of the sleeper that is then woken. (They used to differ: the live
    fleet listed its sleepers oldest first while the plan woke the newest, so with one
    deployment's sleepers on two devices the room could be checked on the wrong one.)
    """
    awake = sum(1 for m in mine if m.awake)
    growth = grant.ready - awake
    if growth <= 0:
        return grant
    free = dict(free)
    sleepers = [m for m in mine if not m.awake]
    extra = wish.awake_bytes - wish.asleep_bytes
    fits, wakes_waiting, start_on = 0, 0, []
    for _ in range(growth):
        if sleepers:
            m = sleepers.pop(0)
            if free.get(m.device, 0) < extra:
                wakes_waiting = 1 + min(len(sleepers), growth - fits - 1)
                break
            free[m.device] -= extra
        else:
            devices = list(grant.start_on[len(start_on) :]) or list(free)
            device = next((d for d in devices if free.get(d, 0) >= wish.awake_bytes), None)
            if device is None:
                break
            free[device] -= wish.awake_bytes
            start_on.append(device)
        fits += 1
    return replace(
        grant,
        ready=awake + fits,
        sleeping=grant.sleeping + wakes_waiting,
        start_on=tuple(start_on),
        denied=grant.denied + growth - fits,
    )
