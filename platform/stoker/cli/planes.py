"""`stoker controller` and `stoker gateway`: the two planes as processes of their own
(`stoker.serve.controller`, `stoker.serve.gateway`). Their flags are `stoker up`'s, each plane taking its own part."""

from __future__ import annotations

import argparse
import os
import secrets
import socket

from stoker.cli.pool_flags import add_pool_args, platform_settings
from stoker.cli.up import (
    activator_config,
    add_activator_args,
    add_limit_args,
    add_request_log_args,
    add_serve_args,
    body_memory,
    default_limits,
    listen_of,
    request_logging,
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
        "--gateway-silent-grace",
        type=duration,
        default=None,
        help="a gateway busy when it went silent (a network cut, this controller stopped) still counts "
        "as that busy this long, so nothing under it is scaled down (default: 60s, or 10x --gateway-stale-after)",
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
        "--engine-tls-secret",
        metavar="NAME",
        help="a TLS Secret (tls.crt naming stoker-engine, tls.key) engine pods serve HTTPS with, verified "
        "against --tls-ca; needed with --tls-cert",
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
    gateway.add_argument(
        "--controller",
        required=True,
        metavar="URL",
        help="the controller's base URL (https:// with --tls-ca: the routing table carries the engines' keys)",
    )
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
    from stoker.serve.controller import run_controller
    from stoker.serve.options import ControllerOptions
    from warm_pool.errors import InvalidConfig

    if args.data_dir:
        os.environ["STOKER_HOME"] = args.data_dir
    # Local engines serve the controller's own certificate; engine pods, the --engine-tls-secret's.
    options = ControllerOptions(
        listen_of(args, launches_engines=args.backend == "local"),
        platform_settings(args),
        gateway_stale_after_s=args.gateway_stale_after,
        gateway_silent_grace_s=args.gateway_silent_grace,
        leave_instances=not args.stop_instances_on_exit,
        kube=_kubernetes(args) if args.backend == "kubernetes" else None,
    )
    if options.listen.tls is not None and options.kube is not None and options.kube.engine_tls_secret is None:
        raise CLIError(
            "--tls-cert with --backend kubernetes needs --engine-tls-secret: the Secret engine pods serve"
        )
    if options.kube is not None and options.listen.tls is not None and options.listen.tls.ca is None:
        raise CLIError("--tls-cert needs --tls-ca: engine pods are verified against that CA")
    if options.kube is not None and options.kube.engine_tls_secret is not None and options.listen.tls is None:
        raise CLIError(
            "--engine-tls-secret needs --tls-cert, --tls-key and --tls-ca: engines are verified against the CA"
        )
    try:
        return run_controller(options)
    except InvalidConfig as exc:  # a setting the backend refuses, before anything is served
        raise CLIError(str(exc)) from None


def _kubernetes(args: argparse.Namespace):
    """The Kubernetes backend's and the Lease's settings (`stoker.serve.options.KubeSettings`)."""
    from lightkube import KubeConfig
    from lightkube.core.exceptions import ConfigError

    from stoker.serve.options import KubeSettings

    if not args.engine_image:
        raise CLIError("--backend kubernetes needs --engine-image (the image instance pods run)")
    try:
        config = (
            KubeConfig.from_file(args.kubeconfig) if args.kubeconfig else KubeConfig.from_service_account()
        )
    except (ConfigError, OSError) as exc:
        raise CLIError(f"cannot read the Kubernetes config: {exc}") from None
    current = config.get()
    return KubeSettings(
        config,
        namespace=args.namespace or (current.namespace if current is not None else None) or "default",
        image=args.engine_image,
        store_path=args.store_path,
        owner=args.owner,
        # Unique per process, as client-go's: a restarted controller does not take its predecessor's
        # lease as its own while that one may still be acting.
        identity=args.identity or f"{socket.gethostname()}_{secrets.token_hex(4)}",
        lease_name=args.lease_name,
        lease_s=args.lease_duration,
        pull_secret=args.s3_secret,
        pull_env={k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION") if k in os.environ},
        engine_tls_secret=args.engine_tls_secret,
    )


def cmd_gateway(args: argparse.Namespace) -> int:
    from stoker.serve.gateway import run_gateway
    from stoker.serve.options import GatewayOptions
    from stoker.tls import controller_url

    if args.data_dir:
        os.environ["STOKER_HOME"] = args.data_dir
    listen = listen_of(args, launches_engines=False)
    options = GatewayOptions(
        listen,
        controller_url(args.controller, listen.tls),
        gateway_id=args.gateway_id or f"{socket.gethostname()}-{os.getpid()}",
        holding=activator_config(args),
        limits=default_limits(args),
        report_interval_s=args.report_interval,
        logging=request_logging(args),
        body_memory_bytes=body_memory(args),
    )
    return run_gateway(options)
