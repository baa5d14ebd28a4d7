"""The values each process shape is started with, as `stoker.cli` parses them from flags and the
environment: checked there (a bad one is a one-line error naming its flag), wired here
(`stoker.serve.up.run_up`, `stoker.serve.controller.run_controller`, `stoker.serve.gateway.run_gateway`).

Types of the control plane are named for the type checker only: a `stoker gateway` process builds a
`GatewayOptions` and imports nothing of `stoker.control` (`tests/platform/gateway/test_imports.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from activator.config import ActivatorConfig
    from stoker.batch.config import BatchConfig
    from stoker.control.prices import PriceTable
    from stoker.control.vllm import VllmOptions
    from stoker.gateway.otel import Tracing
    from stoker.spec.keys import Limits
    from stoker.tls import TlsSettings
    from warm_pool.fleet import Devices


@dataclass(frozen=True)
class Listen:
    """Where a process serves, who is its admin, and its log."""

    host: str
    port: int
    log_level: str
    admin_key: str | None  # None: open mode on loopback (or with --allow-open)
    grace_period_s: float = 60.0  # how long a SIGTERM waits for requests in flight
    tls: TlsSettings | None = None  # None: plain HTTP (`stoker.tls`)


@dataclass(frozen=True)
class RequestLogging:
    """The request log, drift and traces (`stoker.gateway.request_log.Observer`)."""

    max_bytes: int
    files: int
    log_all: bool
    drift_window_s: float
    drift_min_requests: int
    tracing: Tracing | None = None


@dataclass(frozen=True)
class PlatformSettings:
    """`stoker.control.platform.Platform`'s settings from flags: vLLM, shared devices, the pools'."""

    vllm: VllmOptions
    stable_window_s: float
    unavailable_after: int
    devices: Devices | None = None
    instance_kv_bytes: int = 256 << 20
    max_instance_age_s: float | None = None
    warm_runtimes: int = 0
    prices: PriceTable | None = None
    # How often what the control plane learned is checkpointed (`stoker.control.checkpoint`; the
    # default is `--checkpoint-interval`'s); None: never.
    checkpoint_interval_s: float | None = None

    def platform_kwargs(self) -> dict[str, Any]:
        return {
            "prices": self.prices,
            "stable_window_s": self.stable_window_s,
            "vllm": self.vllm,
            "unavailable_after": self.unavailable_after,
            "devices": self.devices,
            "instance_kv_bytes": self.instance_kv_bytes,
            "max_instance_age_s": self.max_instance_age_s,
            "warm_runtimes": self.warm_runtimes,
        }


@dataclass(frozen=True)
class UpOptions:
    """`stoker up`: both planes in one process."""

    listen: Listen
    platform: PlatformSettings
    holding: ActivatorConfig
    limits: Limits  # of tenant keys that set none of their own
    logging: RequestLogging
    batch: BatchConfig | None = None  # the batch API's (`stoker.batch.config`); None: its defaults
    body_memory_bytes: int | None = (
        None  # `--max-body-memory` (`stoker.gateway.body_budget`); None: its default
    )


@dataclass(frozen=True)
class KubeSettings:
    """The Kubernetes backend and the Lease election (`stoker controller --backend kubernetes`)."""

    config: Any  # a lightkube KubeConfig, read from --kubeconfig or the pod's service account
    namespace: str
    image: str
    store_path: str
    owner: str
    identity: str  # this replica's name in the Lease
    lease_name: str
    lease_s: float
    pull_secret: str | None = None
    pull_env: dict[str, str] = field(default_factory=dict)
    engine_tls_secret: str | None = None  # the Secret (tls.crt, tls.key) engine pods serve TLS with


@dataclass(frozen=True)
class ControllerOptions:
    """`stoker controller`: the control plane alone."""

    listen: Listen
    platform: PlatformSettings
    gateway_stale_after_s: float
    leave_instances: bool  # on exit, for the next controller to adopt
    kube: KubeSettings | None = None  # None: the local backend
    gateway_silent_grace_s: float | None = None  # None: `stoker.control.cluster.RoutingTable`'s default


@dataclass(frozen=True)
class GatewayOptions:
    """`stoker gateway`: one data-plane gateway."""

    listen: Listen
    controller: str  # the controller's base URL
    gateway_id: str
    holding: ActivatorConfig
    limits: Limits
    report_interval_s: float
    logging: RequestLogging
    body_memory_bytes: int | None = (
        None  # `--max-body-memory` (`stoker.gateway.body_budget`); None: its default
    )
