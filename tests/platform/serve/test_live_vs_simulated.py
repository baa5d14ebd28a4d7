"""Live equals simulated: one short, time-compressed trace through the real platform and through the
simulator, with the simulator's instance model measured in the same run, and the cold starts compared.

The trace: the Azure code trace, every 50th request from its 30th second to its 915th, time × 0.07:
53 requests in 61 s. A lone request, then 11 s of nothing; busy stretches of up to 5 requests a
second; idle gaps of 6-7 s (the instance sleeps and is woken), one of 12.5 s (it is stopped after
8 s idle) and a burst of 9 requests in a second that finds nothing running. The deployment runs the
default `predictive` policy with one instance at most, `--stable-window 1 --idle-timeout 8`. Every
request asks for 4 tokens (ignore_eos): what varies is when requests come, not how long each takes.

Both sides bind the policy with `warm_pool.policies.settings.bind_policy` from the same settings and
build observations with the same `ObservationTracker`; both call a request a cold start when the
instance that served it became READY (started or woke) after it arrived (the live side counts it in
`stoker_cold_start_requests_total`; `x-stoker-cold-start` says the same for these plain requests).
The simulator is given what this run measured: the mean start-up (decision → READY) of its starts,
the mean wake, and the mean time of a request that was not a cold start.

The tolerance. The simulator has one number for each of those; the live run had a spread, and the
count moves with it: every request that arrives in a start-up window is a cold start, and whether an
idle instance was asleep yet when a request came decides whether that request waited for a wake.
So the test runs the simulator over the spread one live run cannot pin down, and accepts any count
inside that envelope. The start-ups and wakes span what this run measured: the platform's history
(`GET /admin/v1/history`, sampled every 0.25 s here) holds each start's and each wake's own seconds,
and the simulator is run with every start as short as this run's shortest and as long as its
longest (a loaded machine stretches them, and unevenly; the range comes with it, where a fixed
×0.75–1.25 around the mean did not). Wakes likewise, plus the mean +0.5 s (a request that comes
while the instance falls asleep waits for the sleep call as well, which no wake time includes). The
service time ×0.5–2 (a request served alone against eight at once on two cores, as after a start);
and the phase of the simulator's 1 s tick against the trace (0, 0.25, 0.5, 0.75 s: the live loop's
ticks fall anywhere). The envelope is widened by 2 requests for what neither side models: HTTP and
scheduling latency of a few milliseconds can put a request on the other side of a READY moment. The
trace was chosen so the envelope is narrow (about 16-19 cold starts of 53); a pool that stopped
instead of sleeping, or did not wake on demand, or missed the stop, would be off by far more (a
start in the final burst alone catches 9 requests, each sleep turned into a stop adds a start's
worth).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace
from pathlib import Path

import httpx

from tests.deadlines import deadline
from warm_pool.policies.base import ScalingConfig, Tier, TierTimes
from warm_pool.policies.settings import bind_policy
from warm_pool.profiles import InstanceModel
from warm_pool.simulate import Report, simulate
from warm_pool.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[2] / "data" / "azure-llm-code-2023-first29min.csv"  # see its README
THIN, WINDOW_S, TIME_SCALE = 50, (30.0, 915.0), 0.07
TOKENS = 4
STABLE_WINDOW_S, IDLE_TIMEOUT_S, MAX = 1.0, 8.0, 1
SLACK = 2
HISTORY_ENV, HISTORY_S = "STOKER_HISTORY_INTERVAL", 0.25  # one point per start: see `measured_starts`


def compressed_trace() -> tuple[TraceRequest, ...]:
    start, end = WINDOW_S
    kept = [r for r in load_trace(TRACE, thin=THIN) if start <= r.t < end]
    return tuple(TraceRequest((r.t - kept[0].t) * TIME_SCALE, 0, TOKENS) for r in kept)


async def replay(url: str, trace: tuple[TraceRequest, ...]) -> list[tuple[float, bool, int]]:
    """Each request at its time; (seconds it took, x-stoker-cold-start, status) per request."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": TOKENS, "ignore_eos": True}
    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=len(trace))
    async with httpx.AsyncClient(base_url=url, timeout=deadline(120), limits=limits) as client:
        t0 = time.monotonic()

        async def one(at: float) -> tuple[float, bool, int]:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            sent = time.monotonic()
            r = await client.post("/v1/completions", json=body)
            return time.monotonic() - sent, r.headers.get("x-stoker-cold-start") == "true", r.status_code

        return await asyncio.gather(*(one(r.t) for r in trace))


def simulated(
    trace: tuple[TraceRequest, ...], startup_s: float, wake_s: float, service_s: float, phase_s: float = 0.0
) -> Report:
    scaling = ScalingConfig(
        max=MAX, idle_timeout_s=IDLE_TIMEOUT_S, stable_window_s=min(STABLE_WINDOW_S, IDLE_TIMEOUT_S)
    )
    model = InstanceModel(
        startup=TierTimes(wake=wake_s, page_cache=startup_s, disk=startup_s, object_storage=startup_s),
        initial_tier=Tier.PAGE_CACHE,
        prefill_tps=1.0,  # no prompt tokens in the trace: service is all decode
        decode_tps=TOKENS / service_s,
        concurrency=8,  # the engine's --max-num-seqs, as the pool launches it
        jitter=0.0,
    )
    shifted = tuple(replace(r, t=r.t + phase_s) for r in trace)
    return simulate(shifted, bind_policy("predictive", scaling), scaling=scaling, model=model)


def history_since(p, wall: float) -> bool:
    """Whether the platform's history has a point after `wall` (epoch s): the last start is in it."""
    return any(pt["t"] > wall for pt in p.admin_get("/admin/v1/history")["points"])


def measured_starts(p) -> tuple[list[float], list[float]]:
    """Each start's and each wake's seconds (decision to READY), from the platform's history: with
    one instance at most, READY moments are a sleep or a stop apart (a second or more), so each
    0.25 s point holds at most one, and its mean is that start's own time."""
    points = p.admin_get("/admin/v1/history")["points"]
    starts, wakes = [], []
    for pt in points:
        for tier, seconds in pt["deployments"].get("tiny", {}).get("start_s", {}).items():
            (wakes if tier == Tier.WAKE.value else starts).append(seconds)
    return starts, wakes


# A real-time replay: how many requests land inside a start depends on how fast engines start, which
# a loaded machine (CI's two cores, two test files at once) stretches, and unevenly. So the envelope
# is taken from the start-up times this run measured (see the module docstring), not fixed factors.
def test_live_cold_starts_match_the_simulator(platform_factory, tiny_model_dir):
    trace = compressed_trace()
    # No warm runtime: the simulator replays this with one start time for every fresh start, and a
    # platform keeping runtimes has two (the first waits out the runtime's imports, the rest fork).
    p = platform_factory(
        "--stable-window", f"{STABLE_WINDOW_S:g}", "--warm-runtimes", "0", env={HISTORY_ENV: f"{HISTORY_S:g}"}
    )
    p.deploy("tiny", tiny_model_dir, "--max", str(MAX), "--idle-timeout", f"{IDLE_TIMEOUT_S:g}")
    results = asyncio.run(replay(p.url, trace))
    assert all(status == 200 for _, _, status in results)
    ended = time.time()

    live_by_tier = {
        t.value: p.metric("stoker_cold_start_requests_total", deployment="tiny", tier=t.value) for t in Tier
    }
    live = round(sum(live_by_tier.values()))
    assert live == sum(cold for _, cold, _ in results)  # the header and the metric agree

    def total(kind: str, tiers: tuple[str, ...]) -> float:
        return sum(
            p.metric(f"stoker_instance_startup_seconds_{kind}", deployment="tiny", tier=t) for t in tiers
        )

    starts = ("runtime", "page_cache", "disk", "object_storage")
    startup_s = total("sum", starts) / total("count", starts)
    wakes = total("count", ("wake",))
    assert wakes >= 1, "the trace's gaps should have put the instance to sleep and woken it"
    wake_s = total("sum", ("wake",)) / wakes
    warm_times = [seconds for seconds, cold, _ in results if not cold]
    service_s = sum(warm_times) / len(warm_times)

    # The start-up and wake spans, from this run's own starts. A run beside a full `make test` (load
    # 4 on 2 cores) measured starts of 6.35 s and 8.88 s (mean 7.61 s) and wakes of 9 and 31 ms
    # (mean 20 ms): the simulator ran with every start at 6.35, 7.61 and 8.88 s and every wake at
    # 9, 20, 31 and 520 ms, which with the service and phase spans gave 17..22, widened to 15..24,
    # around a live 17. The fixed ×0.75–1.25 around the mean (5.71–9.51 s) covered that run, but
    # not one with starts of 4 s and 11 s (mean 7.5 s: 5.6–9.4 s), whose long start catches the
    # requests of 1.6 s more than any simulated start. The range comes from the history's points
    # (rounded to 1 ms), the mean from the histogram: each span is widened to hold the mean.
    p.wait_for(lambda: history_since(p, ended), what="a history point after the replay")
    each_start, each_wake = measured_starts(p)
    assert len(each_start) >= 1 and len(each_wake) >= 1, (each_start, each_wake)
    start_span = (min(*each_start, startup_s), startup_s, max(*each_start, startup_s))
    wake_span = (min(*each_wake, wake_s), wake_s, max(*each_wake, wake_s), wake_s + 0.5)

    base = simulated(trace, startup_s, wake_s, service_s)
    envelope = [
        simulated(trace, startup, wake, service, phase).cold_starts
        for startup, wake, service, phase in itertools.product(
            start_span, wake_span, (service_s / 2, service_s, service_s * 2), (0.0, 0.25, 0.5, 0.75)
        )
    ]
    low, high = min(envelope) - SLACK, max(envelope) + SLACK
    measured = (
        f"{total('count', starts):g} start-ups {sorted(each_start)} (mean {startup_s:.2f}s), "
        f"{wakes:g} wakes {sorted(each_wake)} (mean {wake_s:.3f}s), service {service_s:.3f}s"
    )
    print(f"live {live} {live_by_tier}; simulated {base.summary()}; envelope {low}..{high}; {measured}")
    assert low <= live <= high, (
        f"live {live} cold starts ({live_by_tier}), simulated {base.cold_starts} "
        f"({base.cold_from_wake} from wake, {base.starts} starts, {base.wakes} wakes), "
        f"envelope {low}..{high}; {measured}"
    )
