"""How engines serve TLS and how every caller verifies them, as one value the composition root
builds (`stoker.tls.TlsSettings.engine_tls`) and hands the backend: the files an engine serves with
(paths as the engine sees them: this machine's, or a pod's mount of a Secret), and the client
context every call to an engine uses (the proxy's, health probes, metrics scrapes, sleep and wake).

An engine's address is known only once it runs (a free port here, a pod's IP there), so engines are
verified by one fixed name, `ENGINE_NAME`, which their certificate must carry, and by the CA that
signed it; the client context checks both whatever address it dialled.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import aiohttp

ENGINE_NAME = "stoker-engine"  # the DNS name every engine certificate carries, and is checked for
MOUNT_DIR = "/etc/stoker/engine-tls"  # where an engine pod has its Secret (tls.crt, tls.key)


@dataclass(frozen=True)
class EngineTls:
    cert: str  # the certificate chain an engine serves, as the engine sees the path
    key: str
    client: ssl.SSLContext  # verifies an engine: its chain to the CA, and `ENGINE_NAME`
    secret: str | None = None  # on Kubernetes: the Secret (tls.crt, tls.key) engine pods mount

    def engine_args(self) -> tuple[str, ...]:
        """`stoker engine`'s and `stoker vllm-serve`'s flags."""
        return ("--tls-cert", self.cert, "--tls-key", self.key)

    def vllm_args(self) -> tuple[str, ...]:
        """`vllm serve`'s own."""
        return ("--ssl-certfile", self.cert, "--ssl-keyfile", self.key)


def of(backend: object) -> EngineTls | None:
    """A backend's (`Backend.engine_tls`); None for one that has none (a test's)."""
    return getattr(backend, "engine_tls", None)


def scheme(tls: EngineTls | None) -> str:
    return "http" if tls is None else "https"


def client_ssl(tls: EngineTls | None) -> ssl.SSLContext | bool:
    """What aiohttp's `ssl=` takes: the engines' context, or its own default (plain HTTP engines)."""
    return True if tls is None else tls.client


def connector(tls: EngineTls | None, **kwargs) -> aiohttp.TCPConnector:
    """A connector for calls to engines (`kwargs` as `aiohttp.TCPConnector`'s)."""
    return aiohttp.TCPConnector(ssl=client_ssl(tls), **kwargs)
