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
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_exponential

from activator.errors import ActivatorError
from activator.source import Endpoint

LOAD_PATH = "/v1/load_lora_adapter"
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
            # The engine has this name with bytes this activator did not load there: another
            # gateway's (the same, most likely) or an earlier revision's under the primary's name.
            # Loaded again in place, so the instance serves exactly these bytes.
            status, text = await self._post(endpoint, ref, inplace=True)
        if status != 200:
            raise AdapterFailed(
                400 if 400 <= status < 500 else 503 if status == 503 else 502,
                f"instance {endpoint.id} could not load adapter {ref.name!r}: {_reason(text, status)}",
            )
        self._held.setdefault(endpoint.id, {})[ref.name] = ref.snapshot_id
        self._on_load(ref.name, time.monotonic() - started)

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
