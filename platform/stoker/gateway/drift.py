"""Drift: how a deployment's traffic and answers move away from a reference window.

Every logged answer (status 200; `stoker.gateway.request_log`) adds to its deployment's current window of
`window_s` seconds. Four statistics are kept per window, each as counts over fixed bins:

| stat | bins |
|---|---|
| `prompt_length` | the prompt's characters: <64, <256, <1024, <4096, <16384, more |
| `output_tokens` | completion tokens: <8, <32, <128, <512, <2048, more |
| `finish_reason` | `stop`, `length`, `tool_calls`, `content_filter`, anything else or none |
| `refusal` | refused or not (`is_refusal`: the answer's first 300 characters hold a refusal phrase) |

The **reference** is the first window that closed with at least `min_requests` answers, or one an
operator pinned (`POST /admin/v1/deployments/NAME/drift/reference`: the last closed window, or the
current one). The **score** of a stat is the population stability index of the last closed window
against the reference:

    PSI = Σ_bins (a − e) · ln(a / e),   a, e: the bin's share in the window and in the reference,
                                        each floored at 0.001 so an empty bin stays finite

0 is no change; under 0.1 little; 0.1–0.25 a moderate shift; over 0.25 a large one. E.g. finish
reasons from 90% `stop`/10% `length` to 50%/50%: (0.5−0.9)·ln(0.5/0.9) + (0.5−0.1)·ln(0.5/0.1)
= 0.235 + 0.644 = 0.88. A window with fewer than `min_requests` answers gets no score.

Exported at each scrape as `stoker_drift_score{deployment,stat}`, with
`stoker_drift_window_requests{deployment,window}` (`reference`, `last`, `current`). Time is a
parameter (`now`): the collector passes the clock's, the tests a logical one.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily

PROMPT_EDGES = (64, 256, 1024, 4096, 16384)
OUTPUT_EDGES = (8, 32, 128, 512, 2048)
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")
STATS = ("prompt_length", "output_tokens", "finish_reason", "refusal")
FLOOR = 0.001
REFUSAL_SCAN_CHARS = 300
# Lower case, straight apostrophes; matched in the answer's first 300 characters.
REFUSAL_PHRASES = (
    "i'm sorry, but",
    "i am sorry, but",
    "i'm sorry, i can",
    "i can't help",
    "i cannot help",
    "i can't assist",
    "i cannot assist",
    "i can't provide",
    "i cannot provide",
    "i'm unable to",
    "i am unable to",
    "i'm not able to",
    "i am not able to",
    "i won't be able to",
    "as an ai language model",
)


def is_refusal(answer: str) -> bool:
    head = answer[:REFUSAL_SCAN_CHARS].lower().replace("\u2019", "'")
    return any(phrase in head for phrase in REFUSAL_PHRASES)


def psi(reference: Iterable[int], window: Iterable[int]) -> float:
    """Population stability index of `window` against `reference` (counts over the same bins)."""
    ref, win = list(reference), list(window)
    ref_n, win_n = sum(ref), sum(win)
    if not ref_n or not win_n:
        return 0.0
    total = 0.0
    for e, a in zip(ref, win, strict=True):
        e, a = max(e / ref_n, FLOOR), max(a / win_n, FLOOR)
        total += (a - e) * math.log(a / e)
    return total


@dataclass
class Window:
    """One window's counts per stat (see the module's table)."""

    start: float
    n: int = 0
    counts: dict[str, list[int]] = field(
        default_factory=lambda: {
            "prompt_length": [0] * (len(PROMPT_EDGES) + 1),
            "output_tokens": [0] * (len(OUTPUT_EDGES) + 1),
            "finish_reason": [0] * (len(FINISH_REASONS) + 1),
            "refusal": [0, 0],
        }
    )

    def add(self, prompt_chars: int, output_tokens: int | None, finish: str | None, refused: bool) -> None:
        self.n += 1
        c = self.counts
        c["prompt_length"][bisect.bisect_right(PROMPT_EDGES, prompt_chars)] += 1
        c["output_tokens"][bisect.bisect_right(OUTPUT_EDGES, output_tokens or 0)] += 1
        reason = FINISH_REASONS.index(finish) if finish in FINISH_REASONS else len(FINISH_REASONS)
        c["finish_reason"][reason] += 1
        c["refusal"][1 if refused else 0] += 1

    def summary(self) -> dict[str, Any]:
        c = self.counts
        return {
            "requests": self.n,
            "counts": {k: list(v) for k, v in c.items()},
            "refusal_rate": c["refusal"][1] / self.n if self.n else None,
        }


@dataclass
class _Track:
    current: Window
    last: Window | None = None
    reference: Window | None = None
    pinned: bool = False


class Drift:
    """Windows per deployment, the reference, the scores. Not thread-safe: the event loop's."""

    def __init__(self, window_s: float = 300.0, min_requests: int = 20) -> None:
        self.check(window_s, min_requests)
        self.window_s = window_s
        self.min_requests = min_requests
        self._tracks: dict[str, _Track] = {}

    @staticmethod
    def check(window_s: float, min_requests: int) -> None:
        """ValueError unless these are a window and a count of answers drift can be scored on."""
        if not 1.0 <= window_s <= 7 * 86400:
            raise ValueError(f"the drift window must be 1 s..7 d, got {window_s:g} s")
        if not 1 <= min_requests <= 1_000_000:
            raise ValueError(f"drift needs 1..1000000 answers a window, got {min_requests}")

    def record(self, record: Any, now: float) -> None:
        """One answer (a `request_log.RequestRecord`) at `now`."""
        track = self._tracks.get(record.deployment)
        if track is None:
            track = self._tracks[record.deployment] = _Track(Window(now))
        self._roll(track, now)
        track.current.add(record.prompt_chars, record.completion_tokens, record.finish_reason, record.refusal)

    def _roll(self, track: _Track, now: float) -> None:
        """Close the current window once `now` is past its end; the next starts on the boundary
        `now` falls in (empty windows in between leave no trace)."""
        start = track.current.start
        if now < start + self.window_s:
            return
        closed = track.current
        track.current = Window(start + self.window_s * math.floor((now - start) / self.window_s))
        if closed.n == 0:
            return
        track.last = closed
        if track.reference is None and closed.n >= self.min_requests:
            track.reference = closed

    def roll(self, now: float) -> None:
        for track in self._tracks.values():
            self._roll(track, now)

    def scores(self, deployment: str) -> dict[str, float]:
        """Each stat's PSI, last closed window against the reference; {} while either is missing
        or the last window is too small."""
        track = self._tracks.get(deployment)
        if track is None or track.reference is None or track.last is None:
            return {}
        if track.last is track.reference or track.last.n < self.min_requests:
            return {stat: 0.0 for stat in STATS} if track.last is track.reference else {}
        ref, last = track.reference.counts, track.last.counts
        return {stat: round(psi(ref[stat], last[stat]), 6) for stat in STATS}

    def pin(self, deployment: str, which: str, now: float) -> Window:
        """Make the last closed window (`last`) or the current one (`current`) the reference.
        Raises LookupError (no such window) or ValueError (too few answers in it)."""
        track = self._tracks.get(deployment)
        if track is not None:
            self._roll(track, now)
        window = None if track is None else track.last if which == "last" else track.current
        if window is None or window.n == 0:
            raise LookupError(f"no {which} window with answers yet for {deployment!r}")
        if window.n < self.min_requests:
            raise ValueError(
                f"the {which} window holds {window.n} answer(s); a reference needs {self.min_requests}"
            )
        assert track is not None
        track.reference, track.pinned = (window if which == "last" else _copy(window)), True
        return track.reference

    def report(self, deployment: str, now: float) -> dict[str, Any] | None:
        track = self._tracks.get(deployment)
        if track is None:
            return None
        self._roll(track, now)
        return {
            "deployment": deployment,
            "window_s": self.window_s,
            "min_requests": self.min_requests,
            "reference_pinned": track.pinned,
            "reference": track.reference.summary() if track.reference else None,
            "last": track.last.summary() if track.last else None,
            "current": track.current.summary(),
            "scores": self.scores(deployment),
        }

    def deployments(self) -> list[str]:
        return sorted(self._tracks)


def _copy(window: Window) -> Window:
    return Window(window.start, window.n, {k: list(v) for k, v in window.counts.items()})


class DriftCollector:
    """The drift gauges, computed at each scrape (windows rolled to the clock's `now` first)."""

    def __init__(self, drift: Drift, clock: Callable[[], float] = time.monotonic) -> None:
        self.drift = drift
        self.clock = clock

    def describe(self):
        return []

    def collect(self):
        self.drift.roll(self.clock())
        score = GaugeMetricFamily(
            "stoker_drift_score",
            "Population stability index of the last closed window against the reference, by statistic",
            labels=["deployment", "stat"],
        )
        sizes = GaugeMetricFamily(
            "stoker_drift_window_requests",
            "Answers in the drift windows (reference, last closed, current)",
            labels=["deployment", "window"],
        )
        for name in self.drift.deployments():
            for stat, value in self.drift.scores(name).items():
                score.add_metric([name, stat], value)
            track = self.drift._tracks[name]
            for label, window in (
                ("reference", track.reference),
                ("last", track.last),
                ("current", track.current),
            ):
                if window is not None:
                    sizes.add_metric([name, label], window.n)
        yield score
        yield sizes


def drift_routes(drift: Drift, platform: Any, clock: Callable[[], float] = time.monotonic) -> list:
    """`GET /admin/v1/deployments/NAME/drift` (the windows and scores) and
    `POST …/drift/reference` (`{"window": "last"|"current"}`: pin the reference). Admin only, as
    every /admin/ path."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from stoker.errors import APIError, invalid
    from stoker.http import parse_json_object, read_body
    from stoker.spec.deployment import not_found

    def existing(request: Request) -> str:
        name = request.path_params["name"]
        if platform.get(name) is None:
            raise not_found(name)
        return name

    async def get(request: Request):
        name = existing(request)
        report = drift.report(name, clock())
        if report is None:  # nothing logged for it yet
            report = {"deployment": name, "window_s": drift.window_s, "min_requests": drift.min_requests,
                      "reference_pinned": False, "reference": None, "last": None, "current": None, "scores": {}}  # fmt: skip
        return JSONResponse(report)

    async def pin(request: Request):
        name = existing(request)
        body = parse_json_object(await read_body(request.receive, request.scope, 1 << 16))
        if unknown := sorted(set(body) - {"window"}):
            raise invalid(f"Unknown field(s) {unknown}; allowed: window.", unknown[0])
        which = body.get("window", "last")
        if which not in ("last", "current"):
            raise invalid(f"'window' must be 'last' or 'current', got {which!r}.", "window")
        try:
            window = drift.pin(name, which, clock())
        except (LookupError, ValueError) as exc:
            raise APIError(
                409, f"Cannot pin the drift reference: {exc}.", code="drift_window_too_small"
            ) from None
        return JSONResponse({"deployment": name, "reference": window.summary(), "pinned": which})

    return [
        Route("/admin/v1/deployments/{name}/drift", get, methods=["GET"]),
        Route("/admin/v1/deployments/{name}/drift/reference", pin, methods=["POST"]),
    ]


def drift_paths(name_param: list[dict[str, Any]]) -> dict[str, Any]:
    """The drift routes in OpenAPI 3.1, for `stoker.api.openapi`."""
    error = {"description": "an error, in OpenAI's shape", "content": {"application/json": {"schema": {"type": "object"}}}}  # fmt: skip
    report = {"description": "the windows and scores", "content": {"application/json": {"schema": {"type": "object"}}}}  # fmt: skip
    body = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"window": {"enum": ["last", "current"], "description": "default: last (closed)"}},
    }
    return {
        "/admin/v1/deployments/{name}/drift": {
            "get": {
                "summary": "Drift: the reference, last and current windows' statistics and each one's PSI",
                "parameters": name_param,
                "responses": {"200": report, "404": error},
            }
        },
        "/admin/v1/deployments/{name}/drift/reference": {
            "post": {
                "summary": "Pin the drift reference: the last closed window, or the current one",
                "parameters": name_param,
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": {"200": report, **{str(c): error for c in (400, 404, 409, 415)}},
            }
        },
    }
