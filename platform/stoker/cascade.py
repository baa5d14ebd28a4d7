"""Cascade routes: a name that answers from a small deployment and escalates to a large one.

A route (`assist` → small `tiny`, large `big`) is called like a deployment (`"model": "assist"`).
A plain (non-streaming) request goes to the small deployment first, with logprobs asked for, and
its answer is kept back, not sent, while it is judged (at most `MAX_ANSWER_BYTES`):

    small answers 200, its choices' mean token logprob ≥ min_mean_logprob ─▶ that answer  (small)
    ... under min_mean_logprob                                            ─▶ large (escalated-unsure)
    small answers 400 "context length exceeded" (both engines' wording),
      or the prompt is clearly longer than its context (below)            ─▶ large (escalated-context)
    small fails before answering (an activator error, or a 5xx)           ─▶ large (escalated-error)
    anything else (another 4xx, an answer with no logprobs or too big)    ─▶ the small one's answer

The client sees one answer; `x-stoker-cascade` says which way it went, and
`x-stoker-cascade-logprob` the small answer's score when it was judged. Logprobs the client did
not ask for are taken out of the answer again (`"logprobs": null`, as when not asked), except from
an answer past `MAX_ANSWER_BYTES`, which goes out as it comes. A limited key is charged the tokens
of the answer it gets (`limits.UsageTap` reads what reaches the client), not the small side's
refused or escalated one.
The answer's `model` is the deployment that answered (what it returns, untouched): a stream's
chunks are relayed unparsed, so rewriting it there would mean parsing every chunk, and the name
tells the client the same thing as the header.

A stream is decided before its first byte only: it goes to the large deployment at once when its
prompt is clearly too long for the small one's context, or when the small one answers a
context-length 400 or a 5xx (those come before any stream byte); otherwise the small one's stream
goes through as it comes, unjudged. A stream held at zero whose keep-alives already went out
(`activator.proxy.Reply.keepalive`) has started its 200: it stays with the small one.

"Clearly too long" is a cheap estimate, no tokenizer: the prompt's UTF-8 bytes / 8 (typical text
is about 4 bytes a token, so this undercounts by half), plus `max_tokens` when given, above the
small snapshot's `max_position_embeddings` (at most 4096 on the CPU engine, which caps it so). An estimate
that is short only costs one refused call to the small one, whose 400 escalates the request then.

Who may call a route: the caller's key must list the route's name AND both deployments; any
other caller gets the 404 a deployment that does not exist gets. So a route never lets a key reach
a deployment it could not call by name, and a key made for `tiny` alone does not gain `assist`.

Metrics (on the platform's registry; `route` is the route's name):

- `stoker_cascade_requests_total{route,outcome}`: outcome small, escalated_unsure,
  escalated_context, escalated_error. The share escalated:
  `1 - sum(rate(stoker_cascade_requests_total{outcome="small"}[5m])) / sum(rate(stoker_cascade_requests_total[5m]))`.
- `stoker_cascade_latency_seconds{route,side}`: each side's time, from the call to its deployment
  to the end of its answer (side small: every call to it, escalated ones too; side large).
- `stoker_cascade_saved_seconds_total{route}` and `stoker_cascade_lost_seconds_total{route}`:
  latency saved against sending everything to the large deployment. For an answer the small one
  gave in t seconds, L − t where L is the mean of the route's last `LARGE_WINDOW` large answers
  (200s), added to saved when positive and to lost when negative; for an escalated request, the
  seconds spent on the small one before escalating, added to lost. Net saving:
  `saved_total - lost_total`. Until the route has seen the large one answer once, small answers
  add to neither (nothing to compare with).
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.openai_errors import UNAVAILABLE, APIError, invalid
from stoker.registry import NAME

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# The activator (aiohttp) and prometheus_client are imported where the serving side is built, not
# here: `stoker routes` (the CLI) takes this module's names, and `stoker --help` stays quick.

log = logging.getLogger("stoker.cascade")

MAX_ANSWER_BYTES = 4 << 20  # a small answer kept back to be judged: the gateway's body bound
MAX_ERROR_BYTES = 64 << 10  # a stream's error answer kept back to be read (as `activator.proxy`)
LARGE_WINDOW = 32  # the large side's recent answers the saving is measured against
LOGPROB_FLOOR = -9999.0  # what both engines write for -inf
BYTES_PER_TOKEN = 8  # the context estimate's, a generous undercount (typical text: about 4)
DEFAULT_MIN_MEAN_LOGPROB = -1.0  # a geometric-mean token probability of e^-1 ≈ 0.37

SMALL = "small"
ESCALATED_UNSURE = "escalated_unsure"
ESCALATED_CONTEXT = "escalated_context"
ESCALATED_ERROR = "escalated_error"
OUTCOMES = (SMALL, ESCALATED_UNSURE, ESCALATED_CONTEXT, ESCALATED_ERROR)

Send = Callable[[MutableMapping[str, Any]], Any]


# ---- the route, validated, and its table -------------------------------------------------------


@dataclass(frozen=True)
class CascadeRoute:
    name: str
    small: str  # a deployment's name
    large: str
    min_mean_logprob: float = DEFAULT_MIN_MEAN_LOGPROB  # escalate answers scoring under this
    escalate_on_context: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FIELDS = ("name", "small", "large", "min_mean_logprob", "escalate_on_context")


def validate_route(body: Any) -> CascadeRoute:
    """A `POST /admin/v1/routes` body, or a 400 naming the field. Whether `small` and `large` are
    deployed is the caller's to check (it knows the platform)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(FIELDS)}.", unknown[0])
    names = {}
    for field in ("name", "small", "large"):
        value = body.get(field)
        if not isinstance(value, str) or not NAME.fullmatch(value):
            what = "the route's name" if field == "name" else "a deployment's name"
            raise invalid(
                f"'{field}' must be {what}: 1-63 lowercase letters, digits, '.', '_' or '-', starting "
                f"with a letter or digit; got {value!r}.",
                field,
            )
        names[field] = value
    if names["small"] == names["large"]:
        raise invalid(f"'large' must be another deployment than 'small' ({names['small']!r}).", "large")
    if names["name"] in (names["small"], names["large"]):
        raise invalid(f"'name' must differ from the deployments it routes to, got {names['name']!r}.", "name")
    threshold = body.get("min_mean_logprob", DEFAULT_MIN_MEAN_LOGPROB)
    if threshold is None:
        threshold = DEFAULT_MIN_MEAN_LOGPROB
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not math.isfinite(threshold)
        or not LOGPROB_FLOOR <= threshold <= 0
    ):
        raise invalid(
            f"'min_mean_logprob' must be a number in {LOGPROB_FLOOR:g}..0 (a mean token logprob), got {threshold!r}.",
            "min_mean_logprob",
        )
    context = body.get("escalate_on_context", True)
    if not isinstance(context, bool):
        raise invalid(f"'escalate_on_context' must be true or false, got {context!r}.", "escalate_on_context")
    return CascadeRoute(names["name"], names["small"], names["large"], float(threshold), context)


def route_not_found(name: str) -> APIError:
    return APIError(
        404, f"No route named {name!r}.", type="not_found_error", param="name", code="route_not_found"
    )


class CascadeRoutes:
    """Routes in SQLite (the registry's `stoker.db`, table `cascade_routes`, its own connection),
    mirrored in memory so that the request path never touches the database."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit; `with` for transactions
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS cascade_routes ("
            " name TEXT PRIMARY KEY, route TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)"
        )
        rows = self._db.execute("SELECT route FROM cascade_routes ORDER BY created_at, name").fetchall()
        self._routes = {r.name: r for r in (CascadeRoute(**json.loads(text)) for (text,) in rows)}

    def put(self, route: CascadeRoute) -> bool:
        """Create or replace `route`; whether it was created."""
        now = time.time()
        with self._db:
            self._db.execute(
                "INSERT INTO cascade_routes (name, route, created_at, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET route = excluded.route, updated_at = excluded.updated_at",
                (route.name, json.dumps(route.to_dict()), now, now),
            )
        created = route.name not in self._routes
        self._routes[route.name] = route
        return created

    def get(self, name: str) -> CascadeRoute | None:
        return self._routes.get(name)

    def delete(self, name: str) -> CascadeRoute:
        route = self._routes.get(name)
        if route is None:
            raise route_not_found(name)
        with self._db:
            self._db.execute("DELETE FROM cascade_routes WHERE name = ?", (name,))
        del self._routes[name]
        return route

    def all(self) -> list[CascadeRoute]:
        return list(self._routes.values())

    def close(self) -> None:
        self._db.close()


# ---- judging an answer, and the requests the two sides get (pure) ------------------------------


def with_logprobs(parsed: dict, chat: bool) -> tuple[dict, bool]:
    """The request asking for logprobs, and whether they were added (to be taken out again).
    A request that asks for them already, or sets them in a way the engine must judge (a bad
    value, chat's `top_logprobs` without `logprobs`), goes as it is."""
    if chat:
        if parsed.get("logprobs") in (None, False) and not parsed.get("top_logprobs"):
            return {**parsed, "logprobs": True}, True
        return parsed, False
    if parsed.get("logprobs") is None:  # completions: an integer N; 0 gives the chosen token's only
        return {**parsed, "logprobs": 0}, True
    return parsed, False


def mean_logprob(answer: Any, skip_prompt: bool = False) -> float | None:
    """The lowest of the answer's choices' mean token logprobs (one unsure choice is enough to
    escalate), or None when no choice carries any. Chat's `logprobs.content[].logprob` and the
    legacy `logprobs.token_logprobs`; `skip_prompt` (a completion with `echo`) leaves out the
    first `usage.prompt_tokens` entries, the prompt's."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return None
    prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens") if skip_prompt else 0
    means = []
    for choice in answer["choices"]:
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(lp, dict):
            continue
        if isinstance(lp.get("content"), list):
            values = [e.get("logprob") for e in lp["content"] if isinstance(e, dict)]
        elif isinstance(lp.get("token_logprobs"), list):
            values = lp["token_logprobs"][prompt_tokens if isinstance(prompt_tokens, int) else 0 :]
        else:
            continue
        numbers = [
            max(float(v), LOGPROB_FLOOR)
            for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)
        ]
        if numbers:
            means.append(sum(numbers) / len(numbers))
    return min(means) if means else None


def without_logprobs(answer: dict) -> dict:
    """The answer as a request that did not ask for logprobs gets it."""
    for choice in answer.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None
    return answer


def context_exceeded(status: int, body: bytes) -> bool:
    """Whether an answer is an engine's "the prompt does not fit the context" 400: the CPU engine's
    (and OpenAI's) code `context_length_exceeded`; vLLM's messages "This model's maximum context
    length is …" and "The decoder prompt (length N) is longer than the maximum model length of M"."""
    if status != 400:
        return False
    try:
        error = json.loads(body)
    except ValueError:
        return False
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        error = error["error"]  # OpenAI's shape; vLLM's older one is the object itself
    if not isinstance(error, dict):
        return False
    message = error.get("message")
    message = message if isinstance(message, str) else ""
    return (
        error.get("code") == "context_length_exceeded"
        or "maximum context length" in message
        or "longer than the maximum model length" in message
    )


def prompt_tokens_at_least(parsed: dict) -> int:
    """A cheap estimate of the tokens a request needs, meant to undercount: the prompt's UTF-8 bytes
    / `BYTES_PER_TOKEN` (token ids count one each) plus `max_tokens` when given."""
    size = 0
    if isinstance(messages := parsed.get("messages"), list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            parts = content if isinstance(content, list) else [content]
            for part in parts:
                text = part.get("text") if isinstance(part, dict) else part
                size += len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0
    tokens = size // BYTES_PER_TOKEN
    prompt = parsed.get("prompt")
    if isinstance(prompt, str):
        tokens = len(prompt.encode("utf-8", "replace")) // BYTES_PER_TOKEN
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens = len(prompt)
    most = parsed.get("max_completion_tokens", parsed.get("max_tokens"))
    if isinstance(most, int) and not isinstance(most, bool) and most > 0:
        tokens += most
    return tokens


def context_of(snapshot_dir: Path, engine: str) -> int | None:
    """A deployment's context, from its snapshot's `max_position_embeddings` (or its text
    config's), capped at 4096 on the CPU engine as it caps it; None when config.json does not say."""
    try:
        config = json.loads((snapshot_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("max_position_embeddings")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("max_position_embeddings")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return None
    return min(value, 4096) if engine == "cpu" else value


# ---- metrics -----------------------------------------------------------------------------------


class CascadeMetrics:
    """The cascade's series (see the module docstring for their definitions)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        from activator.metrics import LATENCY_BUCKETS

        self.requests = Counter(
            "stoker_cascade_requests_total",
            "Requests to cascade routes, by route and outcome (small, escalated_unsure, "
            "escalated_context, escalated_error).",
            ["route", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "stoker_cascade_latency_seconds",
            "Each side's time on a cascade route's request, from the call to its deployment to the end "
            "of its answer (side small: every call to it, escalated ones included).",
            ["route", "side"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.saved = Counter(
            "stoker_cascade_saved_seconds_total",
            "For answers the small deployment gave: the route's recent mean large-side latency minus the "
            "small side's, where positive.",
            ["route"],
            registry=registry,
        )
        self.lost = Counter(
            "stoker_cascade_lost_seconds_total",
            "Seconds spent on the small deployment before escalating, plus, for answers the small one "
            "gave, its latency over the route's recent mean large-side latency. Net saving: saved - lost.",
            ["route"],
            registry=registry,
        )


def saving(small_s: float, recent_large_s: deque[float] | list[float]) -> float | None:
    """Seconds an answer the small side gave in `small_s` saved against the large side's recent
    mean (negative: it cost that much more); None with nothing to compare with.
    E.g. large answers of 2.0, 3.0 and 4.0 s, a small answer in 0.5 s: 3.0 - 0.5 = 2.5 s saved."""
    if not recent_large_s:
        return None
    return sum(recent_large_s) / len(recent_large_s) - small_s


# ---- serving -----------------------------------------------------------------------------------


class Cascades:
    """The routes as the gateway serves them: the table (opened at first use, in the platform's
    `stoker.db`), the lookup on the request path, each route's two-step serving, the metrics.
    `platform` needs `get(name)` (a deployment with `spec` and `serve`) and `data_dir`; with a
    `store` (a `SnapshotStore`) the context pre-check runs too."""

    def __init__(
        self, platform: Any, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._platform = platform
        self._table: CascadeRoutes | None = None
        self.metrics = CascadeMetrics(registry)
        self._clock = clock
        self._large_s: dict[str, deque[float]] = {}  # route -> its last LARGE_WINDOW large answers
        self.counts: dict[str, dict[str, int]] = {}  # route -> outcome -> requests, for the admin API
        self._contexts: dict[str, int] = {}  # snapshot id -> context, read once

    @property
    def table(self) -> CascadeRoutes:
        if self._table is None:
            self._table = CascadeRoutes(Path(self._platform.data_dir) / "stoker.db")
        return self._table

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None

    def conflict(self, name: str) -> APIError | None:
        """The 409 a deploy named like a route gets (`Platform.deploy`'s check), or None."""
        if self.table.get(name) is None:
            return None
        return APIError(
            409,
            f"{name!r} is a cascade route's name; `stoker routes rm {name}` first.",
            param="name",
            code="name_taken",
        )

    def lookup(self, name: str, may_call: Callable[[str], bool]) -> RouteTarget | None:
        """The route `name` as the request path calls it, or None when there is none or the caller
        may not call both its deployments (the caller's right to the route's own name is the
        gateway's check, as for a deployment)."""
        route = self.table.get(name)
        if route is None or not (may_call(route.small) and may_call(route.large)):
            return None
        return RouteTarget(self, route)

    def forget(self, name: str) -> None:
        self._large_s.pop(name, None)
        self.counts.pop(name, None)
        for outcome in OUTCOMES:
            _remove(self.metrics.requests, name, outcome)
        for side in ("small", "large"):
            _remove(self.metrics.latency, name, side)
        _remove(self.metrics.saved, name)
        _remove(self.metrics.lost, name)

    async def serve(
        self,
        route: CascadeRoute,
        scope: MutableMapping[str, Any],
        receive: Callable,
        send: Send,
        parsed: dict,
        stream: bool,
        owner: str,
    ) -> None:
        from activator import ActivatorError

        small, large = self._deployments(route)
        receive = _Watched(receive)
        if route.escalate_on_context and self._too_long(small, parsed):
            await self._escalate(
                route, large, ESCALATED_CONTEXT, None, scope, receive, send, parsed, stream, owner
            )
            return
        added = False
        asked = parsed
        if not stream:
            asked, added = with_logprobs(parsed, chat=scope["path"].endswith("/chat/completions"))
        asked = {**asked, "model": route.small}
        held = _Held(send, MAX_ERROR_BYTES if stream else MAX_ANSWER_BYTES, _held_status(stream))
        started = self._clock()
        try:
            await small.serve(scope, receive, held, _encode(asked), asked, stream, owner)
            failed = None
        except ActivatorError as exc:  # raised only before any header: nothing went out
            failed = exc
        small_s = self._clock() - started
        self.metrics.latency.labels(route.name, "small").observe(small_s)
        if failed is not None:
            log.info(
                "route %s: %s failed (%s); escalating to %s", route.name, route.small, failed, route.large
            )
            self._lost(route, small_s)
            await self._escalate(
                route, large, ESCALATED_ERROR, None, scope, receive, send, parsed, stream, owner
            )
            return
        if held.passed:  # gone out as it came: a stream, an answer past the bound
            self._answered_small(route, small_s, held.status)
            return
        if receive.left or not held.done:  # the client left: nobody to answer
            return
        outcome, score, answer = _judge(route, held, added, parsed)
        if outcome == SMALL:
            await held.release(_tag(held.start, SMALL, score), answer)
            self._answered_small(route, small_s, held.status)
            return
        self._lost(route, small_s)
        await self._escalate(route, large, outcome, score, scope, receive, send, parsed, stream, owner)

    async def _escalate(
        self,
        route: CascadeRoute,
        large: Any,
        outcome: str,
        score: float | None,
        scope: MutableMapping[str, Any],
        receive: Callable,
        send: Send,
        parsed: dict,
        stream: bool,
        owner: str,
    ) -> None:
        self._count(route, outcome)
        asked = {**parsed, "model": route.large}
        status = 0

        async def tagged(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _tag(message, outcome, score)
            await send(message)

        started = self._clock()
        await large.serve(scope, receive, tagged, _encode(asked), asked, stream, owner)
        large_s = self._clock() - started
        self.metrics.latency.labels(route.name, "large").observe(large_s)
        if status == 200:  # an error's time says nothing about the large side's answers
            self._large_s.setdefault(route.name, deque(maxlen=LARGE_WINDOW)).append(large_s)

    def _answered_small(self, route: CascadeRoute, small_s: float, status: int) -> None:
        self._count(route, SMALL)
        if status != 200:
            return
        saved = saving(small_s, self._large_s.get(route.name, ()))
        if saved is None:
            return
        if saved >= 0:
            self.metrics.saved.labels(route.name).inc(saved)
        else:
            self.metrics.lost.labels(route.name).inc(-saved)

    def _lost(self, route: CascadeRoute, seconds: float) -> None:
        self.metrics.lost.labels(route.name).inc(max(0.0, seconds))

    def _count(self, route: CascadeRoute, outcome: str) -> None:
        self.metrics.requests.labels(route.name, outcome).inc()
        self.metrics.saved.labels(route.name)  # both at 0 from the route's first request on
        self.metrics.lost.labels(route.name)
        counts = self.counts.setdefault(route.name, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1

    def _deployments(self, route: CascadeRoute) -> tuple[Any, Any]:
        small, large = self._platform.get(route.small), self._platform.get(route.large)
        for name, deployment in ((route.small, small), (route.large, large)):
            if deployment is None:
                raise APIError(
                    503,
                    f"Route {route.name!r} answers from deployment {name!r}, which is not deployed now.",
                    type=UNAVAILABLE,
                    code="route_deployment_missing",
                )
        return small, large

    def _too_long(self, small: Any, parsed: dict) -> bool:
        """Whether the request clearly does not fit the small deployment's context (the estimate
        undercounts; see the module docstring)."""
        store = getattr(self._platform, "store", None)
        spec = small.spec
        if store is None:
            return False
        context = self._contexts.get(spec.snapshot_id)
        if context is None:
            context = context_of(store.path_of(spec.snapshot_id), spec.engine)
            if context is None:  # not here yet (in object storage only), or no config: no pre-check
                return False
            self._contexts[spec.snapshot_id] = context
        return prompt_tokens_at_least(parsed) > context


@dataclass(frozen=True)
class RouteTarget:
    """A route as the gateway's request path sees it: something with `serve`, as a deployment."""

    cascades: Cascades
    route: CascadeRoute

    async def serve(self, scope, receive, send, body: bytes, parsed: dict, stream: bool, owner: str) -> None:
        await self.cascades.serve(self.route, scope, receive, send, parsed, stream, owner)


def _judge(route: CascadeRoute, held: _Held, added: bool, parsed: dict) -> tuple[str, float | None, bytes]:
    """What a kept-back small answer leads to: (outcome, its score, the body to send if it is the
    answer)."""
    body = b"".join(held.parts)
    if held.status >= 500:
        return ESCALATED_ERROR, None, body
    if route.escalate_on_context and context_exceeded(held.status, body):
        return ESCALATED_CONTEXT, None, body
    if held.status != 200:
        return SMALL, None, body
    try:
        answer = json.loads(body)
    except ValueError:
        return SMALL, None, body
    score = mean_logprob(answer, skip_prompt=parsed.get("echo") is True)
    if score is not None and score < route.min_mean_logprob:
        return ESCALATED_UNSURE, score, body
    if added and isinstance(answer, dict):
        body = json.dumps(without_logprobs(answer)).encode()
    return SMALL, score, body


def _held_status(stream: bool) -> Callable[[int], bool]:
    """Which answers of the small side are kept back: a plain request's all (each is judged); a
    stream's only a 400 (context?) or a 5xx, which come before any stream byte."""
    if stream:
        return lambda status: status == 400 or status >= 500
    return lambda status: True


class _Held:
    """An ASGI `send` that keeps the small side's answer back: its start and its body, up to `limit`
    bytes, when `hold(status)` says so. Any other answer, or one past the limit, goes on to `send`
    as it comes (tagged as the small side's): too late to escalate."""

    __slots__ = ("_hold", "_limit", "_send", "done", "parts", "passed", "size", "start", "status")

    def __init__(self, send: Send, limit: int, hold: Callable[[int], bool]) -> None:
        self._send = send
        self._limit = limit
        self._hold = hold
        self.start: MutableMapping[str, Any] | None = None
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.passed = False  # some of it went out
        self.done = False  # all of it is here

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if self.passed:
            await self._send(message)
            return
        if message["type"] == "http.response.start":
            self.start, self.status = message, message["status"]
            if not self._hold(self.status):
                self.passed = True
                await self._send(_tag(message, SMALL, None))
            return
        chunk = message.get("body", b"")
        self.parts.append(chunk)
        self.size += len(chunk)
        if not message.get("more_body", False):
            self.done = True
        elif self.size > self._limit:
            self.passed = True
            await self._send(_tag(self.start, SMALL, None))
            await self._send({"type": "http.response.body", "body": b"".join(self.parts), "more_body": True})
            self.parts = []

    async def release(self, start: MutableMapping[str, Any], body: bytes) -> None:
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class _Watched:
    """The client's `receive`, noting whether it left (both sides' activators watch it)."""

    __slots__ = ("_receive", "left")

    def __init__(self, receive: Callable) -> None:
        self._receive = receive
        self.left = False

    async def __call__(self) -> MutableMapping[str, Any]:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.left = True
        return message


def _tag(start: MutableMapping[str, Any], outcome: str, score: float | None) -> dict[str, Any]:
    """The response start with the cascade's headers; no content-length (the body may change)."""
    headers = [(n, v) for n, v in start.get("headers", []) if n.lower() != b"content-length"]
    headers.append((b"x-stoker-cascade", outcome.replace("_", "-").encode()))
    if score is not None:
        headers.append((b"x-stoker-cascade-logprob", f"{score:.4f}".encode()))
    return {**start, "headers": headers}


def _encode(parsed: dict) -> bytes:
    return json.dumps(parsed, separators=(",", ":")).encode()


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never observed
        pass
