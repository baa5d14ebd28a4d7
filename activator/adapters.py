"""LoRA adapters on a base deployment's instances, loaded on demand through the engine's run-time
API (vLLM's, which Stoker's CPU engine speaks too): `POST /v1/load_lora_adapter` with the adapter's
name and the directory its files are in on the instance's machine.

    a request for adapter a1 ─▶ an instance holding a1 (affinity by a1's key, within the load bound)
                                 else the least loaded ─▶ loaded there first (one load at a time per
                                 instance and adapter; the others for it wait on that one)
                              ─▶ forwarded with `model` = the name the engine knows it by

The CPU engine keeps at most `--max-adapters` loaded and evicts the least recently used, so what
this remembers of an instance is a hint: an engine that answers 404 for an adapter it had (evicted
since) gets it loaded again and the request once more (`Activator`). vLLM (--enable-lora) keeps every
adapter it loaded registered and reads one it evicted back from its directory itself: there the
404 comes only from an engine that lost it some other way. Each load is timed (`on_load`): the
adapter's own cold start, the tier its scaler and the simulator know.

An engine that already has the name (400 "already loaded": another gateway loaded it there, or the
controller ahead of its request, or an earlier revision's bytes under the primary's name) is asked
for its `/v1/models`: where the name's `root` is this revision's directory (content-addressed: the
same bytes) it is held as it is; otherwise it is loaded again in place.

`Prefetcher` loads an adapter ahead of its request onto the instance a request for it would go to
now (its affinity key's, within the load bound): the predictive policy names the adapters whose
next request it expects (`Decision.adapters`), and the activator's own prefetcher (in one process)
or the controller's (where gateways hold the activators) loads them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_exponential

from activator.balancer import pick_by_prefix
from activator.errors import ActivatorError
from activator.source import Endpoint

log = logging.getLogger("stoker.activator")

LOAD_PATH = "/v1/load_lora_adapter"
MODELS_PATH = "/v1/models"
MAX_MODELS_BYTES = 4 * 1024 * 1024  # an engine's model list: 1024 adapters' cards are ~300 kB
LOAD_TIMEOUT_S = 120.0  # one adapter's files read and applied; a slow disk, not a wedged engine
# An engine whose every adapter slot is held by running requests answers 503; those end soon (the
# one just answered may not have let go of its slot yet), so the load is tried again for this long.
BUSY_WAIT_S = 10.0


@dataclass(frozen=True)
class AdapterRef:
    """The adapter a request asks for: `name`, what the engine calls it (and what the request's
    `model` becomes); `path`, its directory on the instances' machine; `snapshot_id`, its bytes (a
    name loaded with other bytes is loaded again); `key`, its affinity key."""

    name: str
    path: str
    snapshot_id: str
    key: int


class AdapterFailed(ActivatorError):
    """The engine refused to load the adapter: its reason, as the engine gave it."""

    type = "invalid_request_error"
    code = "adapter_load_failed"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Adapters:
    """What each instance holds, as far as this activator has loaded it there."""

    def __init__(
        self, session: Callable[[], aiohttp.ClientSession], on_load: Callable[[str, float], None]
    ) -> None:
        self._session = session
        self._on_load = on_load
        self._held: dict[str, dict[str, str]] = {}  # endpoint id -> adapter name -> snapshot id
        self._loading: dict[tuple[str, str], asyncio.Future] = {}

    def holds(self, endpoint_id: str, ref: AdapterRef) -> bool:
        return self._held.get(endpoint_id, {}).get(ref.name) == ref.snapshot_id

    def forget(self, endpoint_id: str, name: str) -> None:
        """The engine no longer has it (it answered 404 for it: evicted)."""
        self._held.get(endpoint_id, {}).pop(name, None)

    def tracked(self) -> bool:
        return bool(self._held)

    def gone(self, live: set[str]) -> None:
        """Forget the instances that are no longer READY: what is kept is bounded by the live set."""
        for endpoint_id in [e for e in self._held if e not in live]:
            del self._held[endpoint_id]

    async def ensure(self, endpoint: Endpoint, ref: AdapterRef) -> None:
        """`ref` loaded on `endpoint`: at once if it is known to be, else loaded now (or by the
        load already under way for it). AdapterFailed with the engine's reason if it refused."""
        if self.holds(endpoint.id, ref):
            return
        k = (endpoint.id, ref.name)
        pending = self._loading.get(k)
        if pending is None:
            pending = asyncio.ensure_future(self._load(endpoint, ref))
            self._loading[k] = pending
            pending.add_done_callback(lambda _: self._loading.pop(k, None))
        await asyncio.shield(pending)

    async def _load(self, endpoint: Endpoint, ref: AdapterRef) -> None:
        started = time.monotonic()
        retrying = AsyncRetrying(
            retry=retry_if_result(lambda answer: answer[0] == 503),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(BUSY_WAIT_S),
            retry_error_callback=lambda state: state.outcome.result(),  # still busy: its 503, below
        )
        status, text = await retrying(self._post, endpoint, ref, inplace=False)
        if status == 400 and "already" in text:
            # The engine has this name, loaded by another gateway or the controller (these bytes,
            # most likely), or an earlier revision's under the primary's name: held as it is if its
            # directory is this revision's, else loaded again in place.
            if await self._root(endpoint, ref.name) == ref.path:
                self._held.setdefault(endpoint.id, {})[ref.name] = ref.snapshot_id
                return
            status, text = await self._post(endpoint, ref, inplace=True)
        if status != 200:
            raise AdapterFailed(
                400 if 400 <= status < 500 else 503 if status == 503 else 502,
                f"instance {endpoint.id} could not load adapter {ref.name!r}: {_reason(text, status)}",
            )
        self._held.setdefault(endpoint.id, {})[ref.name] = ref.snapshot_id
        self._on_load(ref.name, time.monotonic() - started)

    async def _root(self, endpoint: Endpoint, name: str) -> str | None:
        """The directory the engine's `/v1/models` says adapter `name` was loaded from, or None
        (not listed, or an answer that cannot be read: then it is loaded again, which is safe)."""
        try:
            async with self._session().get(
                endpoint.url + MODELS_PATH,
                headers=dict(endpoint.auth_headers),
                timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S),
            ) as resp:
                if resp.status != 200 or (resp.content_length or 0) > MAX_MODELS_BYTES:
                    return None
                raw = await resp.content.read(MAX_MODELS_BYTES + 1)
            cards = json.loads(raw)["data"] if len(raw) <= MAX_MODELS_BYTES else []
            root = next((c.get("root") for c in cards if isinstance(c, dict) and c.get("id") == name), None)
            return root if isinstance(root, str) else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError):
            return None

    async def _post(self, endpoint: Endpoint, ref: AdapterRef, *, inplace: bool) -> tuple[int, str]:
        body: dict = {"lora_name": ref.name, "lora_path": ref.path}
        if inplace:
            body["load_inplace"] = True  # vLLM's, and the CPU engine's: replace what the name holds
        headers = {**endpoint.auth_headers, "content-type": "application/json"}
        try:
            async with self._session().post(
                endpoint.url + LOAD_PATH,
                data=json.dumps(body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S),
            ) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise AdapterFailed(
                502, f"loading adapter {ref.name!r} on {endpoint.id} failed: {exc!r}"
            ) from None


def _reason(text: str, status: int) -> str:
    """The engine's error message (OpenAI's error JSON), or its status and the start of its body."""
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:500]
        if isinstance(error, str):
            return error[:500]
    except (ValueError, AttributeError):
        pass
    return f"{status} {text[:200]}"


class Prefetcher:
    """Adapters loaded ahead of their requests, each onto the instance a request for it would go to
    now: the first on the ring from its affinity key below the load bound (`pick_by_prefix`, as the
    activator routes it). `endpoints`, `outstanding` and `bound` are the routing's: the activator's
    own, or in a controller the pool's READY instances and the gateways' reported load."""

    def __init__(
        self,
        adapters: Adapters,
        endpoints: Callable[[], Sequence[Endpoint]],
        outstanding: Callable[[], Mapping[str, int]],
        bound: Callable[[], float],
    ) -> None:
        self.adapters = adapters
        self._endpoints, self._outstanding, self._bound = endpoints, outstanding, bound

    async def prefetch(self, ref: AdapterRef) -> str | None:
        """Load `ref` where its next request would go: that instance's id, or None when no instance
        is READY or that one holds it already. A refusal is logged, not raised: the request, when it
        comes, loads it (or meets the refusal) as it would have."""
        endpoints = self._endpoints()
        self.adapters.gone({e.id for e in endpoints})  # what instances gone held: forgotten
        endpoint = pick_by_prefix(endpoints, self._outstanding(), ref.key, self._bound())
        if endpoint is None or self.adapters.holds(endpoint.id, ref):
            return None
        try:
            await self.adapters.ensure(endpoint, ref)
        except AdapterFailed as exc:
            log.warning("prefetching adapter %s: %s", ref.name, exc)
            return None
        return endpoint.id
