"""`stoker controller` and `stoker gateway`: the two planes as processes of their own
(`stoker.serve.controller`, `stoker.serve.gateway`). Their flags are `stoker up`'s, each plane taking its own part."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from urllib.parse import urlsplit

from stoker.cli.up import (
    access_of,
    activator_config,
    add_activator_args,
    add_limit_args,
    add_pool_args,
    add_request_log_args,
    add_serve_args,
    admin_key_of,
    build_platform,
    default_limits,
    log_setup,
    request_observer,
    serve,
)
from stoker.errors import CLIError
from stoker.paths import add_store_args
from stoker.spec.durations import duration


def register(sub: argparse._SubParsersAction) -> None:
    controller = sub.add_parser(
        "controller", help="run the control plane: registry, pools, policies, the backend (gateways route)"
    )
    for add in (add_serve_args, add_pool_args):
        add(controller)
    controller.set_defaults(port=8081)
    controller.add_argument(
        "--gateway-stale-after",
        type=duration,
        default="5s",
        help="a gateway silent this long is gone: its load stops counting, its share of each instance goes",
    )
    controller.add_argument(
        "--stop-instances-on-exit",
        action="store_true",
        help="drain and stop every instance on exit (default: leave them for the next controller to adopt)",
    )
    controller.add_argument(
        "--data-dir",
        metavar="DIR",
        help="the registry, keys and records (default: $STOKER_HOME, else ~/.stoker)",
    )
    controller.add_argument(
        "--backend", choices=["local", "kubernetes"], default="local", help="where instances run"
    )
    kube = controller.add_argument_group("the kubernetes backend")
    kube.add_argument("--namespace", help="where instance pods go (default: the controller's own namespace)")
    kube.add_argument(
        "--kubeconfig", metavar="PATH", help="the API server's config (default: the pod's service account)"
    )
    kube.add_argument("--engine-image", metavar="IMAGE", help="the image instance pods run (required)")
    kube.add_argument(
        "--store-path",
        metavar="PATH",
        default="/mnt/nvme/stoker",
        help="the snapshot store on every node (a hostPath the node agent fills)",
    )
    kube.add_argument(
        "--owner", default="stoker", help="labels this install's pods: two installs never adopt each other's"
    )
    kube.add_argument(
        "--s3-secret", metavar="NAME", help="a Secret with the S3 credentials snapshot pulls use"
    )
    kube.add_argument(
        "--lease-name", default="stoker-controller", help="the Lease that elects one controller"
    )
    kube.add_argument("--identity", help="this replica's name in the Lease (default: <hostname>_<random>)")
    kube.add_argument(
        "--lease-duration",
        type=duration,
        default="15s",
        help="how long a Lease not renewed stays held (renewed every third of it): a standby's wait",
    )
    add_store_args(controller)
    controller.set_defaults(func=cmd_controller)

    gateway = sub.add_parser(
        "gateway", help="run a data-plane gateway: OpenAI's API, held requests, the proxy"
    )
    for add in (add_serve_args, add_activator_args, add_limit_args, add_request_log_args):
        add(gateway)
    gateway.add_argument("--controller", required=True, metavar="URL", help="the controller's base URL")
    gateway.add_argument(
        "--gateway-id",
        help="this gateway's name in the controller's reports (default: <hostname>-<pid>)",
    )
    gateway.add_argument(
        "--report-interval", type=duration, default="1s", help="time between load reports to the controller"
    )
    gateway.add_argument(
        "--data-dir",
        metavar="DIR",
        help="this gateway's request log (default: $STOKER_HOME, else ~/.stoker)",
    )
    gateway.set_defaults(func=cmd_gateway)


def cmd_controller(args: argparse.Namespace) -> int:
    from stoker.http import ServerStopping
    from stoker.serve.controller import build_controller
    from stoker.spec.keys import NO_LIMITS

    if args.data_dir:
        os.environ["STOKER_HOME"] = args.data_dir
    admin_key = admin_key_of(args)
    log_setup(args)
    extra, leader = {}, None
    if args.backend == "kubernetes":
        extra, leader = _kubernetes(args)
    stopping = ServerStopping()
    platform = build_platform(
        args, controller=True, gateway_stale_after_s=args.gateway_stale_after, stopping=stopping, **extra
    )
    access = access_of(args, admin_key, NO_LIMITS)
    holder: dict = {}
    app = build_controller(
        platform,
        access=access,
        leave_instances=not args.stop_instances_on_exit,
        leader=leader,
        on_lost_lease=lambda: setattr(holder["server"], "should_exit", True),
    )
    return serve(app, args, stopping, holder)


def _kubernetes(args: argparse.Namespace) -> tuple[dict, object]:
    """The Kubernetes backend, its pods' GPUs, and the Lease election, from the flags."""
    from lightkube import AsyncClient, KubeConfig
    from lightkube.core.exceptions import ConfigError

    from stoker.control.leader import LeaderElector
    from warm_pool.backends.kube import KubeBackend, PodGpus

    if not args.engine_image:
        raise CLIError("--backend kubernetes needs --engine-image (the image instance pods run)")
    try:
        config = (
            KubeConfig.from_file(args.kubeconfig) if args.kubeconfig else KubeConfig.from_service_account()
        )
    except (ConfigError, OSError) as exc:
        raise CLIError(f"cannot read the Kubernetes config: {exc}") from None
    current = config.get()
    namespace = args.namespace or (current.namespace if current is not None else None) or "default"
    client = AsyncClient(config=config, namespace=namespace)
    pull_env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION") if k in os.environ}
    try:
        backend = KubeBackend(
            client,
            namespace,
            image=args.engine_image,
            store_path=args.store_path,
            owner=args.owner,
            pull_env=pull_env,
            pull_secret=args.s3_secret,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    # Unique per process, as client-go's: a restarted controller does not take its predecessor's
    # lease as its own while that one may still be acting.
    identity = args.identity or f"{socket.gethostname()}_{secrets.token_hex(4)}"
    lease = args.lease_duration
    leader = LeaderElector(client, namespace, args.lease_name, identity, lease_s=lease, renew_s=lease / 3)
    return {"backend": backend, "gpus": PodGpus()}, leader


def cmd_gateway(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from stoker.gateway.keys import Access
    from stoker.gateway.plane import GatewayPlane
    from stoker.http import own_origins
    from stoker.serve.gateway import build_data_gateway

    if args.data_dir:
        os.environ["STOKER_HOME"] = args.data_dir
    admin_key = admin_key_of(args)
    controller = _controller_url(args.controller)
    log_setup(args)
    observer = request_observer(args)  # this gateway's request log, drift and traces
    holding, limits = activator_config(args), default_limits(args)
    gateway_id = args.gateway_id or f"{socket.gethostname()}-{os.getpid()}"
    plane = GatewayPlane(
        controller,
        admin_key,
        gateway_id,
        holding,
        CollectorRegistry(),
        report_interval_s=args.report_interval,
    )
    observer.register(plane.metrics_registry)
    access = Access(admin_key, plane.keys, own_origins(args.host, args.port), limits)
    return serve(build_data_gateway(plane, access=access, observer=observer), args)


def _controller_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise CLIError(f"--controller must be a base URL like http://controller:8081, got {url!r}")
    return url.rstrip("/")
