"""What the platform says to a running engine, the same on every backend: HTTP to its address,
with its key. Sleep and wake (`POST /sleep?level=N`, `POST /wake_up`: the CPU engine and vLLM in its
dev mode answer the same routes), what it can do (`GET /server_info`), and how its start went (its
`stoker_engine_startup_phase_seconds`, else the phases vLLM logged).

Anything but a 200 in time is a `PoolError` naming the engine and what it answered; the pool then
treats the instance as failed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from warm_pool import engine_tls, reconcile
from warm_pool.backends.base import Backend
from warm_pool.engine_tls import EngineTls, connector
from warm_pool.errors import PoolError
from warm_pool.reconcile import Observed
from warm_pool.vllm import startup_phases

STARTUP_PHASE_METRIC = "stoker_engine_startup_phase_seconds"
Headers = Mapping[str, str] | None  # an instance's `auth_headers`: its key
_LOG_PHASE_BYTES = 1 << 20  # vLLM logs a few hundred lines while it starts; its phases are in them
_MAX_INFO_BYTES = 1 << 20  # vLLM's /server_info holds its whole config and environment: ~25 KB


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine said it can do. An engine that said nothing can do nothing optional.

    The two answers to `GET /server_info?config_format=json`:

    - the CPU engine's: `{"engine": "stoker", "sleep_levels": [1, 2]}`;
    - vLLM's (dev mode only; vLLM 0.32's `entrypoints/serve/dev/server_info`):
      `{"vllm_config": {"model_config": {"enable_sleep_mode": false, ...}, "cache_config": ...},
      "vllm_env": {...}, "system_env": {...}}`, its `VllmConfig` dumped by pydantic in JSON mode
      (`--enable-sleep-mode` is `ModelConfig.enable_sleep_mode`). Without `config_format=json`,
      `vllm_config` is the config's text (a string), which says nothing here. A real answer,
      trimmed, is tests/data/vllm-0.32.0-cpu-server-info.json.
    """

    sleep_levels: tuple[int, ...] = ()

    @property
    def can_sleep(self) -> bool:
        return 1 in self.sleep_levels

    @classmethod
    def parse(cls, body: bytes) -> EngineCapabilities:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return cls()
        if not isinstance(doc, dict):
            return cls()
        levels = doc.get("sleep_levels")
        if isinstance(levels, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in levels):
            return cls(tuple(sorted(set(levels))))
        config = doc.get("vllm_config")
        model = config.get("model_config") if isinstance(config, dict) else None
        if isinstance(model, dict) and model.get("enable_sleep_mode") is True:
            return cls((1, 2))  # vLLM's sleep mode: level 1 offloads weights to host, level 2 drops them
        return cls()


class HttpEngines:
    """The engine calls of one backend's instances (its `read_log` is the fallback for phases)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._tls = engine_tls.of(backend)  # its engines on HTTPS, verified so

    async def sleep(self, url: str, level: int, timeout_s: float, headers: Headers = None) -> None:
        """Put the engine at `url` to sleep (level 1: weights to host RAM, accelerator freed)."""
        await _post(url, f"/sleep?level={level}", timeout_s, headers, self._tls)

    async def wake_up(self, url: str, timeout_s: float, headers: Headers = None) -> None:
        """Wake the engine at `url`: weights back, ready for requests when this returns."""
        await _post(url, "/wake_up", timeout_s, headers, self._tls)

    async def observe_sleep(self, url: str, headers: Headers = None) -> Observed:
        """Whether the engine sleeps (`GET /is_sleeping`, `warm_pool.reconcile.read_answer`); an
        engine without sleep mode serves no such route, and one that answers `/health` is awake."""
        try:
            async with aiohttp.ClientSession(
                connector=connector(self._tls), timeout=aiohttp.ClientTimeout(total=10)
            ) as session:
                async with session.get(url + reconcile.PATH, headers=headers) as r:
                    observed = reconcile.read_answer(
                        r.status, await r.content.read(reconcile.MAX_BODY_BYTES + 1)
                    )
                if observed is Observed.UNKNOWN:
                    async with session.get(url + "/health", headers=headers) as r:
                        observed = Observed.AWAKE if r.status == 200 else Observed.UNKNOWN
        except (aiohttp.ClientError, TimeoutError, OSError):
            return Observed.UNKNOWN
        return observed

    async def read_startup_phases(
        self, url: str, instance_id: str | None = None, headers: Headers = None
    ) -> dict[str, float]:
        """`{phase: seconds}` from the engine's `stoker_engine_startup_phase_seconds`, else (vLLM)
        from the phases vLLM logged (`warm_pool.vllm.startup_phases`); `{}` if neither can be read:
        these numbers are informative only."""
        phases = await self._phases_from_metrics(url, headers)
        if not phases and instance_id is not None:
            text = await self._backend.read_log(instance_id, _LOG_PHASE_BYTES)
            phases = startup_phases(text) if text is not None else {}
        return phases

    async def read_capabilities(self, url: str, headers: Headers = None) -> EngineCapabilities:
        """What the engine at `url` says it can do (`GET /server_info?config_format=json`): the CPU
        engine lists its sleep levels; vLLM reports its config, whose `enable_sleep_mode` means levels
        1 and 2. An engine without that route (vLLM outside dev mode, where /sleep is not served
        either) cannot be put to sleep."""
        try:
            async with (
                aiohttp.ClientSession(connector=connector(self._tls)) as session,
                session.get(
                    url + "/server_info",
                    params={"config_format": "json"},
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as r,
            ):
                if r.status != 200:
                    return EngineCapabilities()
                body = await r.content.read(_MAX_INFO_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError):
            return EngineCapabilities()
        return EngineCapabilities.parse(body[:_MAX_INFO_BYTES] if len(body) <= _MAX_INFO_BYTES else b"")

    async def _phases_from_metrics(self, url: str, headers: Headers = None) -> dict[str, float]:
        try:
            async with (
                aiohttp.ClientSession(connector=connector(self._tls)) as session,
                session.get(url + "/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r,
            ):
                if r.status != 200:
                    return {}
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        phases: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                if family.name != STARTUP_PHASE_METRIC:
                    continue
                for sample in family.samples:
                    if "phase" in sample.labels:
                        phases[sample.labels["phase"]] = sample.value
        except ValueError:
            return {}
        return phases


async def _post(
    url: str, path: str, timeout_s: float, headers: Headers = None, tls: EngineTls | None = None
) -> None:
    try:
        async with (
            aiohttp.ClientSession(connector=connector(tls)) as session,
            session.post(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r,
        ):
            if r.status != 200:
                body = (await r.text())[:200].replace("\n", " ")
                raise PoolError(f"POST {url}{path} answered {r.status}: {body}")
    except (aiohttp.ClientError, OSError) as exc:
        raise PoolError(f"POST {url}{path} failed: {type(exc).__name__}: {exc}") from None
    except TimeoutError:
        raise PoolError(f"POST {url}{path}: no answer within {timeout_s:g}s") from None
