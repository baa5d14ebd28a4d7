"""Replay a request trace through a scaling policy in virtual time: a discrete-event simulation.

The policy is the very function the live pool calls, built by `warm_pool.policies.make_policy`,
and its observations are built by the same `ObservationTracker` the pool uses, fed the same events
(arrivals, completions, rejections, finished starts). The loop ticks every `tick_s` (1 s) and also
at once when a request arrives to find no free slot, as the live pool is poked.

The instance model (`InstanceModel`; two presets, `GPU` the default and `CPU`):

- an engine can sleep unless `can_sleep` is False (vLLM's CPU build has no sleep mode): then the
  observation says so and no instance is ever put to sleep, whatever a decision asks;
- a start takes `startup.<tier>` seconds, the tier being where the snapshot is when it begins: page
  cache while any instance of the deployment exists or for `page_cache_ttl_s` after the last one
  stopped or the snapshot was warmed, else local disk (or object storage, until the first start or
  warm has fetched it); a wake takes `startup.wake`;
- with `warm_runtimes` N, N runtimes are ready at t=0; a start from the page cache or local disk
  takes a ready one and lasts `startup.runtime` (tier runtime), and the runtime taken is replaced
  `runtime_refill_s` later (a fresh process's imports; by default the page-cache start time);
- a request holds one of `concurrency` slots for context / prefill_tps + generated / decode_tps
  seconds (decode_tps per stream), times a log-normal jitter (σ = `jitter`) drawn per request
  from the seed before the run, so every policy sees the same service times; TTFT = wait + prefill;
- requests that find no free slot wait FIFO, at most `max_queue` of them (more are rejected at
  once) and for at most `deadline_s` (then rejected): the activator's defaults, 100 and 120 s.

Applying a decision is `warm_pool.plan.plan`, the very function the pool carries out (a start is
always allowed here, and a sleep is instant, so nothing is ever falling asleep): more READY first
takes back instances that are out of routing waiting for their last requests before going to sleep
(the sleep has not happened yet), then wakes sleeping ones and starts the rest; fewer cancels
starts (newest first), then takes the least busy READY instances out of routing and, once their
in-flight requests finish, puts them to sleep (while fewer sleep than asked) or stops them; surplus
sleeping instances are stopped, the longest asleep first. The
observation counts instances on their way to sleep as sleeping.

A restart (`Restart`): at the first tick at or after `at_s` the controller is taken to have
restarted, and the policy's state becomes what `carry` makes of it: the state read back from a
checkpoint (`warm_pool.policies.checkpoint`), or the initial state of a controller that kept none.
Everything else carries on, as a restarted controller that adopts its running instances finds them:
the instances in their states and the requests on them, and the tracker's measurements (its
start-up times and idle gaps are the platform's, not the policy's). Only what the checkpoint holds
is put to the test.

Accounting: `gpu_seconds` = READY instance-seconds (draining ones included: they hold the GPU;
priced × `Prices.gpus`, the devices each instance holds),
`starting_seconds` = starting and waking, `sleep_seconds` = SLEEPING. A request is a cold start if
it was served by an instance that became READY (started or woke) after the request arrived.
The run ends when the last request is served or rejected.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from warm_pool import plan
from warm_pool.census import Census, Member
from warm_pool.errors import InvalidConfig
from warm_pool.policies import BoundPolicy
from warm_pool.policies.base import Decision, ScalingConfig, Tier
from warm_pool.policies.rules import RuledState
from warm_pool.profiles import GPU, InstanceModel
from warm_pool.trace import TraceRequest
from warm_pool.tracker import ObservationTracker

SNAPSHOT_ID = "trace-snapshot"


@dataclass(frozen=True)
class Prices:
    """On-demand list prices, roughly: an H100-class GPU-hour, and the host RAM (16 GB of weights
    at ~$0.005 per GB-hour) that a sleeping 8B instance holds."""

    gpu_per_hour: float = 3.00
    sleep_per_hour: float = 0.08
    gpus: int = 1  # each instance's devices (a deployment's `gpus`): its awake hours cost that many

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"an instance holds at least 1 device, got {self.gpus}")


@dataclass(frozen=True)
class Report:
    policy: str
    requests: int
    served: int
    rejected: int
    cold_starts: int  # served by an instance that started or woke after the request arrived
    cold_from_wake: int  # of those, the instance woke (the rest: it started)
    cold_start_share: float
    p50_wait_s: float
    p99_wait_s: float
    p99_ttft_s: float
    gpu_seconds: float
    starting_seconds: float
    sleep_seconds: float
    starts: int
    wakes: int
    cost_usd: float
    cost_per_1k_requests: float
    duration_s: float
    timeline: tuple[tuple[float, int, float, int, int, int, int], ...] = field(default=(), repr=False)
    # (t, arrivals in the tick before t, forecast req/s or NaN, ready, starting, waking, sleeping)
    runtime_starts: int = 0  # of `starts`, those a warm runtime took

    def summary(self) -> dict[str, object]:
        """The report without the timeline, rounded for JSON and tables."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            if name == "timeline":
                continue
            value = getattr(self, name)
            out[name] = round(value, 4) if isinstance(value, float) else value
        return out


@dataclass(frozen=True)
class Restart:
    """The controller restarts at `at_s` (trace seconds); its policy state becomes `carry(state)`."""

    at_s: float
    carry: Callable[[RuledState], RuledState]


class _Instance:
    __slots__ = ("asleep_since", "began", "busy", "id", "leaving", "ready_since", "state", "tier")

    def __init__(self, ident: int, state: str, tier: Tier, now: float) -> None:
        self.id, self.state, self.tier, self.began = ident, state, tier, now
        self.busy = 0
        self.leaving: str | None = None  # "sleep" or "stop" once out of routing
        self.ready_since = math.inf
        self.asleep_since = 0.0  # when it last fell asleep: the longest asleep are stopped first


_READY_EVENT, _DONE, _ARRIVAL, _DEADLINE, _WARMED, _TICK, _RUNTIME = range(7)


class Simulation:
    """One run of one policy over one trace; `run()` returns the `Report`."""

    def __init__(
        self,
        trace: tuple[TraceRequest, ...],
        policy: BoundPolicy,
        *,
        model: InstanceModel = GPU,
        scaling: ScalingConfig,
        prices: Prices | None = None,
        seed: int = 0,
        tick_s: float = 1.0,
        restart: Restart | None = None,
    ) -> None:
        if not trace:
            raise InvalidConfig("trace", "the trace has no requests")
        self.trace, self.policy, self.model, self.scaling = trace, policy, model, scaling
        self.prices = prices or Prices()
        self.tick_s = tick_s
        rng = random.Random(seed)
        self._jitter = [rng.lognormvariate(0.0, model.jitter) if model.jitter else 1.0 for _ in trace]
        self.tracker = ObservationTracker(model.startup)
        self._state = policy.initial_state
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._instances: dict[int, _Instance] = {}
        self._queue: deque[int] = deque()  # request indices, FIFO
        self._queued: set[int] = set()
        self._done = 0
        self._now = 0.0
        self._acct_at = 0.0
        self._seconds = {"gpu": 0.0, "starting": 0.0, "sleep": 0.0}
        self._on_disk = model.initial_tier != Tier.OBJECT_STORAGE
        self._cache_until = model.page_cache_ttl_s if model.initial_tier == Tier.PAGE_CACHE else -math.inf
        self._warming = False
        self._runtimes = model.warm_runtimes  # ready warm runtimes (refills are events)
        self._runtime_starts = 0
        self.outcomes: list[str | None] = [None] * len(trace)  # "served" or "rejected", set once
        # Per request, the tier of the instance a cold start waited for (WAKE: a wake); None: warm.
        self.cold_tiers: list[Tier | None] = [None] * len(trace)
        self._restart = restart
        self._waits: list[float] = []
        self._ttfts: list[float] = []
        self._cold = self._cold_wake = self._rejected = self._starts = self._wakes = 0
        self._tick_arrivals = 0
        self._timeline: list[tuple[float, int, float, int, int, int, int]] = []

    # ---- the event loop ------------------------------------------------------------------------------

    def run(self) -> Report:
        for i, req in enumerate(self.trace):
            self._push(req.t, _ARRIVAL, i)
        self._push(0.0, _TICK, None)
        handlers = {
            _READY_EVENT: self._on_ready,
            _DONE: self._on_done,
            _ARRIVAL: self._on_arrival,
            _DEADLINE: self._on_deadline,
            _WARMED: self._on_warmed,
            _TICK: self._on_tick,
            _RUNTIME: self._on_runtime,
        }
        while self._events and self._done < len(self.trace):
            t, kind, _, data = heapq.heappop(self._events)
            self._advance(t)
            handlers[kind](data)
        return self._report()

    def _push(self, t: float, kind: int, data: object) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), data))

    def _advance(self, t: float) -> None:
        dt = t - self._acct_at
        if dt > 0:
            for inst in self._instances.values():
                key = {"ready": "gpu", "starting": "starting", "waking": "starting", "sleeping": "sleep"}
                self._seconds[key[inst.state]] += dt
        self._acct_at = self._now = max(self._now, t)

    # ---- requests ------------------------------------------------------------------------------------

    def _on_arrival(self, i: int) -> None:
        now = self._now
        self.tracker.arrived(now)
        self._tick_arrivals += 1
        inst = self._free_instance(i) if not self._queued else None
        if inst is not None:
            self._dispatch(i, inst)
            return
        if len(self._queued) >= self.model.max_queue:
            self._reject(i)
        else:
            self._queue.append(i)
            self._queued.add(i)
            self._push(now + self.model.deadline_s, _DEADLINE, i)
        self._tick(poked=True)

    def _free_instance(self, i: int) -> _Instance | None:
        """The least busy READY instance in routing with a free slot, for request `i`."""
        best = None
        for inst in self._instances.values():
            if inst.state == "ready" and inst.leaving is None and inst.busy < self.model.concurrency:
                if best is None or inst.busy < best.busy:
                    best = inst
        return best

    def _dispatch(self, i: int, inst: _Instance) -> None:
        now, req, m = self._now, self.trace[i], self.model
        self._settle(i, "served")
        inst.busy += 1
        jitter = self._jitter[i]
        prefill = req.context_tokens / m.prefill_tps * jitter
        service = prefill + req.generated_tokens / m.decode_tps * jitter
        before = self._before_service(i, inst)
        wait = now - req.t + before
        self._waits.append(wait)
        self._ttfts.append(wait + prefill)
        if inst.ready_since > req.t:
            self.cold_tiers[i] = inst.tier
            self._cold += 1
            self._cold_wake += inst.tier == Tier.WAKE
        self._push(now + before + service, _DONE, (i, inst.id, before + service))

    def _before_service(self, i: int, inst: _Instance) -> float:
        """Seconds request `i`, holding a slot of `inst`, waits there before its service begins: none
        here (a subclass's hook: `warm_pool.adapter_sim`'s adapter load)."""
        return 0.0

    def _drain_queue(self) -> None:
        while self._queue:
            i = self._queue[0]
            if i in self._queued:
                inst = self._free_instance(i)
                if inst is None:
                    return
                self._queued.discard(i)
                self._dispatch(i, inst)
            self._queue.popleft()

    def _on_done(self, data: object) -> None:
        _, inst_id, service = data  # type: ignore[misc]
        self.tracker.finished(self._now, service)
        self._done += 1
        inst = self._instances.get(inst_id)
        if inst is not None:
            inst.busy -= 1
            if inst.leaving is not None and inst.busy == 0:
                self._leave(inst)
        self._drain_queue()

    def _on_deadline(self, i: int) -> None:
        if i in self._queued:
            self._queued.discard(i)
            self._reject(i)

    def _settle(self, i: int, outcome: str) -> None:
        if self.outcomes[i] is not None:
            raise AssertionError(f"request {i} {outcome} after it was already {self.outcomes[i]}")
        self.outcomes[i] = outcome

    def _reject(self, i: int) -> None:
        self._settle(i, "rejected")
        self.tracker.finished(self._now, None)
        self._rejected += 1
        self._done += 1

    # ---- instances -----------------------------------------------------------------------------------

    def _cached_tier(self) -> Tier:
        if self._instances or self._now < self._cache_until:
            return Tier.PAGE_CACHE
        return Tier.DISK if self._on_disk else Tier.OBJECT_STORAGE

    def _start_tier(self) -> Tier:
        """Where a start would come from now: a warm runtime if one is ready and the snapshot is here."""
        tier = self._cached_tier()
        return Tier.RUNTIME if self._runtimes > 0 and tier in (Tier.PAGE_CACHE, Tier.DISK) else tier

    def _on_runtime(self, _: object) -> None:
        self._runtimes += 1

    def _start(self) -> None:
        tier = self._start_tier()
        if tier == Tier.RUNTIME:
            self._runtimes -= 1
            self._runtime_starts += 1
            refill = self.model.runtime_refill_s
            self._push(
                self._now + (self.model.startup.page_cache if refill is None else refill), _RUNTIME, None
            )
        inst = _Instance(next(self._ids), "starting", tier, self._now)
        self._instances[inst.id] = inst
        self._starts += 1
        self._push(self._now + self.model.startup.of(tier), _READY_EVENT, inst.id)

    def _wake(self, inst: _Instance) -> None:
        inst.state, inst.tier, inst.began = "waking", Tier.WAKE, self._now
        self._wakes += 1
        self._push(self._now + self.model.startup.wake, _READY_EVENT, inst.id)

    def _on_ready(self, inst_id: int) -> None:
        inst = self._instances.get(inst_id)
        if inst is None or inst.state not in ("starting", "waking"):
            return  # cancelled meanwhile
        self.tracker.started(inst.tier, self._now - inst.began)
        inst.state, inst.ready_since = "ready", self._now
        self._on_disk = True
        self._drain_queue()

    def _leave(self, inst: _Instance) -> None:
        """An instance out of routing with nothing in flight: asleep or gone."""
        if inst.leaving == "sleep":
            inst.state, inst.leaving, inst.asleep_since = "sleeping", None, self._now
        else:
            self._remove(inst)

    def _remove(self, inst: _Instance) -> None:
        del self._instances[inst.id]
        if not self._instances:
            self._cache_until = max(self._cache_until, self._now + self.model.page_cache_ttl_s)

    def _on_warmed(self, _: object) -> None:
        self._warming, self._on_disk = False, True
        self._cache_until = max(self._cache_until, self._now + self.model.page_cache_ttl_s)

    # ---- the control loop ----------------------------------------------------------------------------

    def _on_tick(self, _: object) -> None:
        self._tick(poked=False)
        self._push(self._now + self.tick_s, _TICK, None)

    def _counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("ready", "starting", "waking", "sleeping", "leaving", "to_sleep"), 0)
        for inst in self._instances.values():
            counts["leaving" if inst.leaving else inst.state] += 1
            counts["to_sleep"] += inst.leaving == "sleep"
        return counts

    def _tick(self, *, poked: bool) -> None:
        now, counts = self._now, self._counts()
        in_flight = sum(inst.busy for inst in self._instances.values())
        observation = self.tracker.observe(
            now,
            in_flight=in_flight,
            queued=len(self._queued),
            ready=counts["ready"],
            starting=counts["starting"],
            sleeping=counts["sleeping"] + counts["to_sleep"],
            waking=counts["waking"],
            cached_tier=self._start_tier(),
            snapshot_id=SNAPSHOT_ID,
            can_sleep=self.model.can_sleep,
        )
        if self._restart is not None and now >= self._restart.at_s:
            self._state, self._restart = self._restart.carry(self._state), None
        decision, self._state = self.policy.decide(observation, self._state, now)
        self._apply(decision.ready, decision.sleeping, bool(decision.warm))
        self._decided(decision)
        if not poked:
            after = self._counts()
            forecast = decision.forecast if decision.forecast is not None else math.nan
            self._timeline.append(
                (now, self._tick_arrivals, forecast, after["ready"] + after["leaving"], after["starting"],
                 after["waking"], after["sleeping"])
            )  # fmt: skip
            self._tick_arrivals = 0

    def _decided(self, decision: Decision) -> None:
        """After a decision is applied: nothing here (a subclass's hook: `warm_pool.adapter_sim`
        loads the adapters it names ahead of their requests)."""

    def _apply(self, want_ready: int, want_sleeping: int, warm: bool) -> None:
        """Carry out `warm_pool.plan`'s actions, as the pool does, in virtual time."""
        insts = {str(i.id): i for i in self._instances.values()}

        def group(test) -> tuple[Member, ...]:
            return tuple(
                Member(k, created_at=float(i.id), state_since=i.asleep_since)
                for k, i in insts.items()
                if test(i)
            )

        census = Census(
            routing=group(lambda i: i.state == "ready" and i.leaving is None),
            coming=group(lambda i: i.state == "starting"),
            waking=group(lambda i: i.state == "waking"),
            asleep=group(lambda i: i.state == "sleeping"),
            to_sleep=group(lambda i: i.leaving == "sleep"),
        )
        outstanding = {k: i.busy for k, i in insts.items()}
        actions = plan.plan(
            want_ready,
            want_sleeping,
            census,
            can_sleep=self.model.can_sleep,
            may_start=True,
            outstanding=outstanding,
        )
        for action in actions:
            match action:
                case plan.TakeBack(id=ident):
                    insts[ident].leaving = None  # not asleep yet: back into routing at no cost
                case plan.Wake(id=ident):
                    self._wake(insts[ident])
                case plan.Start():
                    self._start()
                case plan.Cancel(id=ident):
                    self._remove(insts[ident])
                case plan.Sleep(id=ident) | plan.Drain(id=ident, grace=True):
                    inst = insts[ident]
                    inst.leaving = "sleep" if isinstance(action, plan.Sleep) else "stop"
                    if inst.busy == 0:
                        self._leave(inst)
                case plan.Drain(id=ident):
                    self._remove(insts[ident])
        tier = self._cached_tier()
        if warm and not self._warming and tier != Tier.PAGE_CACHE:
            self._warming = True
            read_s = self.model.startup.of(tier) - self.model.startup.page_cache
            self._push(self._now + max(0.0, read_s), _WARMED, None)
        elif warm and tier == Tier.PAGE_CACHE and not self._instances:
            self._cache_until = max(self._cache_until, self._now + self.model.page_cache_ttl_s)

    # ---- the report ----------------------------------------------------------------------------------

    def _report(self) -> Report:
        n, served = len(self.trace), len(self._waits)
        gpu, starting, sleep = self._seconds["gpu"], self._seconds["starting"], self._seconds["sleep"]
        awake_usd = (gpu + starting) * self.prices.gpus * self.prices.gpu_per_hour / 3600
        cost = awake_usd + sleep * self.prices.sleep_per_hour / 3600
        return Report(
            policy=self.policy.name,
            requests=n,
            served=served,
            rejected=self._rejected,
            cold_starts=self._cold,
            cold_from_wake=self._cold_wake,
            cold_start_share=self._cold / n,
            p50_wait_s=_percentile(self._waits, 50),
            p99_wait_s=_percentile(self._waits, 99),
            p99_ttft_s=_percentile(self._ttfts, 99),
            gpu_seconds=gpu,
            starting_seconds=starting,
            sleep_seconds=sleep,
            starts=self._starts,
            wakes=self._wakes,
            cost_usd=cost,
            cost_per_1k_requests=cost / n * 1000,
            duration_s=self._now,
            timeline=tuple(self._timeline),
            runtime_starts=self._runtime_starts,
        )


def _percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def simulate(
    trace: tuple[TraceRequest, ...],
    policy: BoundPolicy,
    *,
    scaling: ScalingConfig,
    model: InstanceModel = GPU,
    prices: Prices | None = None,
    seed: int = 0,
    tick_s: float = 1.0,
    restart: Restart | None = None,
) -> Report:
    """Replay `trace` through `policy`; deterministic for a given seed."""
    return Simulation(
        trace, policy, model=model, scaling=scaling, prices=prices, seed=seed, tick_s=tick_s, restart=restart
    ).run()
