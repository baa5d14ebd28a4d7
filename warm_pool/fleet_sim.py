"""Several deployments on shared devices, in one virtual clock: the fleet simulator.

Each deployment is a `warm_pool.simulate.Simulation` (its own trace, policy, `ObservationTracker`,
instances, queue and accounting), but their events share one heap and one clock, and every decision
goes through the fleet arbiter (`warm_pool.arbiter.arbitrate`) before the apply step
(`warm_pool.plan.plan`), as the live pools go through `warm_pool.fleet`:

1. A deployment's tick (every second, and at once when a request finds no free slot) builds its
   observation and asks its policy, exactly as the single-deployment simulator does.
2. Its `Wish`: the decision's READY and SLEEPING, the instance's awake and asleep bytes, the rate
   (the decision's forecast, else the arrivals of the last 60 s per second), the horizon (the
   measured wake time), the requests held now and when the oldest of them arrived.
3. `arbitrate` runs over the latest wish of every deployment sharing the devices, their instances
   (awake: starting, waking or READY, draining ones included; busy: requests in flight) and the
   devices. An instance draining to stop is no member: its bytes are taken off its device instead.
4. A deployment the grant leaves with fewer awake than it has (the arbiter put one to sleep, or
   stopped a sleeper, to make room) carries its grant out at once: its pool would be poked, and a
   sleep here is instant when the instance is idle (the arbiter never picks a busy one).
5. The asking deployment's growth is then limited to what fits in the memory free now by the
   function the live fleet calls (`warm_pool.arbiter.fits_now`): wakes on the sleeper's own device,
   newest sleeper first (the one the plan wakes), fresh starts on the grant's `start_on` devices, else on the first device
   with room. What does not fit waits for a later tick, its requests held.

Warm runtimes (`InstanceModel.warm_runtimes`, each deployment its own here) hold `runtime_bytes` each
on their group's first device while ready (a GPU runtime's CUDA context): members of no deployment,
which the arbiter counts as held, as the live fleet counts the keeper's (`warm_pool.runtimes`).

Modes: `shared` puts every deployment on the same devices; `dedicated` gives each deployment one
device of its own (a fleet of one per deployment, still one clock, so the runs end together).

Accounting: a deployment's `device_seconds` is its awake instance-seconds (READY, starting, waking);
the fleet's is the seconds each device had anything awake on it, summed over devices, and
`peak_devices` the most devices with anything awake at once. A slow cold start is a request served
by an instance that was started (a fresh process, not a wake) after the request arrived.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from warm_pool import simulate as sim
from warm_pool.arbiter import Device, Grant, Wish, arbitrate, fits_now
from warm_pool.census import Member
from warm_pool.errors import InvalidConfig
from warm_pool.fleet import ASLEEP_RESIDUAL as RESIDUALS
from warm_pool.policies import BoundPolicy
from warm_pool.policies.base import Decision, ScalingConfig
from warm_pool.policies.settings import bind_policy
from warm_pool.profiles import GPU, InstanceModel
from warm_pool.trace import TraceRequest

GB = 1 << 30
# What a sleeping vLLM instance keeps on its GPU (its CUDA context): the live fleet's figure.
ASLEEP_RESIDUAL = RESIDUALS["vllm"]
RATE_WINDOW_S = 60.0  # the arrivals a wish's rate is taken from when the policy makes no forecast
MAX_INSTANCES = 16  # a deployment's `max`, at most (as `stoker simulate`'s default)
MODES = ("shared", "dedicated")


@dataclass(frozen=True)
class FleetDeployment:
    name: str
    trace: tuple[TraceRequest, ...]
    awake_bytes: int  # weights + KV budget
    asleep_bytes: int = ASLEEP_RESIDUAL
    policy: str = "predictive"


@dataclass(frozen=True)
class DeploymentReport:
    name: str
    policy: str
    requests: int
    rejected: int
    slow_cold_starts: int
    wakes: int
    starts: int
    evicted: int  # instances put to sleep (or stopped asleep) to make room for another deployment
    p99_wait_s: float
    device_seconds: float

    def summary(self) -> dict[str, object]:
        keys = ("name", "requests", "rejected", "slow_cold_starts", "wakes", "p99_wait_s", "device_seconds")
        return {k: _rounded(getattr(self, k)) for k in keys}


@dataclass(frozen=True)
class FleetReport:
    mode: str
    devices: int
    requests: int
    rejected: int
    slow_cold_starts: int
    wakes: int
    p99_wait_s: float
    device_seconds: float
    peak_devices: int
    deployments: tuple[DeploymentReport, ...]
    duration_s: float
    peak_used: dict[str, int] = field(default_factory=dict)  # most bytes reserved at once, per device
    memory: int = 0  # each device's bytes
    peak_reserved: int = 0  # the most bytes reserved at once on all devices together

    def summary(self) -> dict[str, object]:
        """The JSON line `stoker simulate --fleet --json` prints."""
        keys = ("mode", "devices", "requests", "rejected", "slow_cold_starts", "wakes", "p99_wait_s")
        out = {k: _rounded(getattr(self, k)) for k in keys}
        out |= {"device_seconds": _rounded(self.device_seconds), "peak_devices": self.peak_devices}
        return out | {"deployments": [d.summary() for d in self.deployments]}


def _rounded(value: object) -> object:
    return round(value, 4) if isinstance(value, float) else value


class _Recording:
    """The bound policy, remembering its last decision (the wish needs its forecast)."""

    def __init__(self, bound: BoundPolicy) -> None:
        self.name, self.initial_state, self._decide = bound.name, bound.initial_state, bound.decide
        self.last: Decision | None = None

    def decide(self, observation, state, now):
        decision, state = self._decide(observation, state, now)
        self.last = decision
        return decision, state


class _Deployment(sim.Simulation):
    """One deployment of the fleet: `Simulation` with its events on the fleet's heap and its apply
    step going through the arbiter."""

    def __init__(self, fleet: FleetSimulation, spec: FleetDeployment, scaling: ScalingConfig, **kw) -> None:
        super().__init__(spec.trace, _Recording(bind_policy(spec.policy, scaling)), scaling=scaling, **kw)
        self.fleet, self.spec, self.name = fleet, spec, spec.name
        self.device_of: dict[int, str] = {}
        self.wish: Wish | None = None
        self.evicted = 0
        self._start_on: list[str] = []
        self._recent: deque[float] = deque()

    # ---- the simulator's hooks -----------------------------------------------------------------------

    def _push(self, t: float, kind: int, data: object) -> None:
        self.fleet.push(t, kind, self, data)

    def _on_arrival(self, i: int) -> None:
        self._recent.append(self._now)
        super()._on_arrival(i)

    def _start(self) -> None:
        super()._start()
        self.device_of[max(self._instances)] = self._start_on.pop(0)  # ids only grow

    def _remove(self, inst) -> None:
        super()._remove(inst)
        self.device_of.pop(inst.id, None)

    def _apply(self, want_ready: int, want_sleeping: int, warm: bool) -> None:
        self.wish = self._wish(want_ready, want_sleeping)
        ready, sleeping = self._fits_now(self.fleet.grant(self))
        super()._apply(ready, sleeping, warm)

    # ---- the fleet's side ----------------------------------------------------------------------------

    def handlers(self) -> dict[int, object]:
        return {
            sim._READY_EVENT: self._on_ready,
            sim._DONE: self._on_done,
            sim._ARRIVAL: self._on_arrival,
            sim._DEADLINE: self._on_deadline,
            sim._WARMED: self._on_warmed,
            sim._TICK: self._on_tick,
            sim._RUNTIME: self._on_runtime,
        }

    def begin(self) -> None:
        for i, req in enumerate(self.trace):
            self._push(req.t, sim._ARRIVAL, i)
        self._push(0.0, sim._TICK, None)

    @property
    def finished(self) -> bool:
        return self._done >= len(self.trace)

    def active(self) -> int:
        """Routing + starting + waking: what `plan` counts against READY."""
        return sum(1 for i in self._instances.values() if i.state != "sleeping" and i.leaving is None)

    def sleepers(self) -> int:
        return sum(1 for i in self._instances.values() if i.state == "sleeping" or i.leaving == "sleep")

    def give_way(self, grant: Grant) -> bool:
        """Carry out another deployment's arbitration at once where it takes room from this one: an
        awake instance to be put to sleep, or a sleeper to be stopped. Growth granted here waits for
        this deployment's own tick (its sleepers to be woken are kept meanwhile). True if it acted."""
        active = self.active()
        growth = max(0, grant.ready - active)
        if grant.ready >= active and grant.sleeping + growth >= self.sleepers():
            return False
        self.evicted += max(0, active - grant.ready)
        self._start_on = []
        sim.Simulation._apply(self, min(grant.ready, active), grant.sleeping + growth, False)
        return True

    def _wish(self, ready: int, sleeping: int) -> Wish:
        while self._recent and self._recent[0] <= self._now - RATE_WINDOW_S:
            self._recent.popleft()
        last = self.policy.last
        forecast = last.forecast if last is not None else None
        rate = forecast if forecast else len(self._recent) / RATE_WINDOW_S
        return Wish(
            self.name,
            ready,
            sleeping,
            self.spec.awake_bytes,
            self.spec.asleep_bytes,
            rate=rate,
            horizon_s=self.tracker.startup.wake,
            held=len(self._queued),
            held_since=min((self.trace[i].t for i in self._queued), default=math.inf),
        )

    def _fits_now(self, grant: Grant) -> tuple[int, int]:
        """The grant's READY and SLEEPING cut to the growth that fits the memory free now, as the live
        fleet cuts it (`arbiter.fits_now`); the devices of the starts it grants are kept for `_start`."""
        members = [i for i in sorted(self._instances.values(), key=lambda i: i.id) if i.leaving != "stop"]
        awake = [i for i in members if i.state != "sleeping"]
        # Sleepers newest first, as the live seat lists them: the one the plan wakes.
        sleepers = sorted((i for i in members if i.state == "sleeping"), key=lambda i: -i.id)
        mine = [
            Member(str(i.id), self.name, self.device_of[i.id], i.state != "sleeping")
            for i in awake + sleepers
        ]
        now = fits_now(grant, mine, self.wish, self.fleet.free(self))
        self._start_on = list(now.start_on)
        return now.ready, now.sleeping


@dataclass
class _Group:
    """Deployments sharing some devices."""

    deployments: list[_Deployment]
    devices: list[Device]


class FleetSimulation:
    """One run of a fleet; `run()` returns the `FleetReport`."""

    def __init__(
        self,
        deployments: Sequence[FleetDeployment],
        *,
        devices: int,
        device_memory: int,
        mode: str = "shared",
        model: InstanceModel = GPU,
        seed: int = 0,
        tick_s: float = 1.0,
        record: bool = False,
        runtime_bytes: int = 0,  # what each ready warm runtime holds on its group's first device
    ) -> None:
        if mode not in MODES:
            raise InvalidConfig("mode", f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not deployments:
            raise InvalidConfig("deployments", "a fleet needs at least one deployment")
        if len({d.name for d in deployments}) != len(deployments):
            raise InvalidConfig("deployments", "deployment names must be distinct")
        if mode == "dedicated":
            devices = len(deployments)
        if devices < 1 or device_memory <= 0:
            raise InvalidConfig("devices", "a fleet needs at least one device with memory > 0")
        for d in deployments:
            if not 0 < d.awake_bytes <= device_memory or not 0 <= d.asleep_bytes <= d.awake_bytes:
                raise InvalidConfig(
                    d.name,
                    f"deployment {d.name}: its awake footprint must fit one device ({device_memory} bytes)",
                )
        self.mode, self.memory, self.record = mode, device_memory, record
        self.runtime_bytes = runtime_bytes
        all_devices = [Device(f"gpu{i}", device_memory) for i in range(devices)]
        self._heap: list[tuple[float, int, int, _Deployment, object]] = []
        self._seq = itertools.count()
        self._group: dict[str, _Group] = {}
        shared = _Group([], all_devices)
        self.deployments: list[_Deployment] = []
        for n, spec in enumerate(deployments):
            group = shared if mode == "shared" else _Group([], [all_devices[n]])
            fits = sum(device_memory // spec.awake_bytes for _ in group.devices)
            scaling = ScalingConfig(max=min(MAX_INSTANCES, fits), target_concurrency=model.concurrency)
            dep = self._deployment(spec, scaling, model=model, seed=seed + n, tick_s=tick_s)
            group.deployments.append(dep)
            self._group[spec.name] = group
            self.deployments.append(dep)
        self.devices = all_devices
        self._acct_at = 0.0
        self._device_seconds = 0.0
        self.peak_devices = self.peak_reserved = 0
        self.peak_used = dict.fromkeys((d.id for d in all_devices), 0)
        self.timeline: list[tuple[float, dict[str, int], dict[str, int]]] = []  # (t, used, awake) if record

    def _deployment(self, spec: FleetDeployment, scaling: ScalingConfig, **kw) -> _Deployment:
        """One deployment of the fleet (a subclass's hook: `warm_pool.adapter_sim`'s bases)."""
        return _Deployment(self, spec, scaling, **kw)

    def push(self, t: float, kind: int, dep: _Deployment, data: object) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), dep, data))

    # ---- arbitration ---------------------------------------------------------------------------------

    def grant(self, asking: _Deployment) -> Grant:
        group = self._group[asking.name]
        draining: dict[str, int] = {}
        members = []
        for dep in group.deployments:
            # Oldest first, as the live pool lists its instances (see `arbiter.fits_now`).
            for inst in sorted(dep._instances.values(), key=lambda i: i.id):
                device = dep.device_of[inst.id]
                if inst.leaving == "stop":
                    draining[device] = draining.get(device, 0) + dep.spec.awake_bytes
                    continue
                members.append(
                    Member(f"{dep.name}/{inst.id}", dep.name, device, inst.state != "sleeping", inst.busy > 0)
                )
        held = sum(dep._runtimes for dep in group.deployments) * self.runtime_bytes
        if held:  # the warm runtimes' memory, held by no deployment
            members.append(Member("runtimes", "(warm runtimes)", group.devices[0].id, False, holds=held))
        devices = [Device(d.id, d.memory - draining.get(d.id, 0)) for d in group.devices]
        wishes = [dep.wish for dep in group.deployments if dep.wish is not None]
        grants = arbitrate(wishes, members, devices)
        for dep in group.deployments:
            g = grants.get(dep.name)
            if (
                dep is not asking
                and g is not None
                and (g.ready < dep.active() or g.sleeping < dep.sleepers())
            ):
                dep.give_way(g)
        return grants[asking.name]

    def used(self, devices: Sequence[Device] | None = None) -> dict[str, int]:
        """Bytes reserved on each device now: awake footprints, and residuals of the asleep."""
        used = dict.fromkeys((d.id for d in devices or self.devices), 0)
        for dep in self.deployments:
            first = self._group[dep.name].devices[0].id
            if first in used:
                used[first] += dep._runtimes * self.runtime_bytes
            for inst in dep._instances.values():
                device = dep.device_of[inst.id]
                if device in used:
                    used[device] += (
                        dep.spec.asleep_bytes if inst.state == "sleeping" else dep.spec.awake_bytes
                    )
        return used

    def free(self, dep: _Deployment) -> dict[str, int]:
        devices = self._group[dep.name].devices
        used = self.used(devices)
        return {d.id: d.memory - used[d.id] for d in devices}

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self) -> FleetReport:
        handlers = {id(dep): dep.handlers() for dep in self.deployments}
        for dep in self.deployments:
            dep.begin()
        while self._heap and not all(dep.finished for dep in self.deployments):
            t, kind, _, dep, data = heapq.heappop(self._heap)
            self._advance(t)
            handlers[id(dep)][kind](data)
            self._observe(t, kind)
        return self._report()

    def _advance(self, t: float) -> None:
        dt = t - self._acct_at
        if dt > 0:
            self._device_seconds += dt * self._in_use()
            self._acct_at = t
        for dep in self.deployments:
            dep._advance(t)

    def _in_use(self) -> int:
        busy = {
            dep.device_of[i.id]
            for dep in self.deployments
            for i in dep._instances.values()
            if i.state != "sleeping"
        }
        return len(busy)

    def _observe(self, t: float, kind: int) -> None:
        used = self.used()
        for device, n in used.items():
            self.peak_used[device] = max(self.peak_used[device], n)
        self.peak_reserved = max(self.peak_reserved, sum(used.values()))
        self.peak_devices = max(self.peak_devices, self._in_use())
        if self.record and kind == sim._TICK:
            awake = {
                d.name: sum(1 for i in d._instances.values() if i.state != "sleeping")
                for d in self.deployments
            }
            self.timeline.append((t, used, awake))

    def _report(self) -> FleetReport:
        rows, waits = [], []
        for dep in self.deployments:
            r = dep._report()
            waits += dep._waits
            rows.append(
                DeploymentReport(
                    dep.name,
                    r.policy,
                    r.requests,
                    r.rejected,
                    r.cold_starts - r.cold_from_wake,
                    r.wakes,
                    r.starts,
                    dep.evicted,
                    r.p99_wait_s,
                    r.gpu_seconds + r.starting_seconds,
                )
            )
        return FleetReport(
            mode=self.mode,
            devices=len(self.devices),
            requests=sum(r.requests for r in rows),
            rejected=sum(r.rejected for r in rows),
            slow_cold_starts=sum(r.slow_cold_starts for r in rows),
            wakes=sum(r.wakes for r in rows),
            p99_wait_s=sim._percentile(waits, 99),
            device_seconds=self._device_seconds,
            peak_devices=self.peak_devices,
            deployments=tuple(rows),
            duration_s=self._acct_at,
            peak_used=dict(self.peak_used),
            memory=self.memory,
            peak_reserved=self.peak_reserved,
        )


def simulate_fleet(
    deployments: Sequence[FleetDeployment],
    *,
    devices: int,
    device_memory: int,
    mode: str = "shared",
    model: InstanceModel = GPU,
    seed: int = 0,
) -> FleetReport:
    """Replay every deployment's trace on `devices` shared devices (`shared`), or each on a device of
    its own (`dedicated`; the policies are the deployments' own: a kpa baseline names kpa in each)."""
    return FleetSimulation(
        deployments, devices=devices, device_memory=device_memory, mode=mode, model=model, seed=seed
    ).run()


def rotate(trace: tuple[TraceRequest, ...], shift_s: float) -> tuple[TraceRequest, ...]:
    """`trace` shifted by `shift_s` within its own length (rounded up to a whole second, + 1 s), the
    requests pushed past the end coming round to the start: the same traffic, at another time."""
    if not trace or shift_s == 0:
        return trace
    period = math.floor(trace[-1].t) + 1.0
    moved = [TraceRequest((r.t + shift_s) % period, r.context_tokens, r.generated_tokens) for r in trace]
    return tuple(sorted(moved, key=lambda r: r.t))
