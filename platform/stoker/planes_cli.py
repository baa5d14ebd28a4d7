"""`stoker controller` and `stoker gateway`: the two planes as processes of their own
(`stoker.planes`). Their flags are `stoker up`'s, each plane taking its own part."""

from __future__ import annotations

import argparse
import os
import socket
from urllib.parse import urlsplit

from stoker.durations import duration
from stoker.errors import CLIError
from stoker.paths import add_store_option
from stoker.platform_cli import (
    _access,
    _activator_config,
    _admin_key,
    _default_limits,
    _log_setup,
    _platform,
    _serve,
    add_activator_args,
    add_limit_args,
    add_pool_args,
    add_serve_args,
)


def add_parsers(sub: argparse._SubParsersAction) -> None:
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
    add_store_option(controller)
    controller.set_defaults(func=cmd_controller)

    gateway = sub.add_parser(
        "gateway", help="run a data-plane gateway: OpenAI's API, held requests, the proxy"
    )
    for add in (add_serve_args, add_activator_args, add_limit_args):
        add(gateway)
    gateway.add_argument("--controller", required=True, metavar="URL", help="the controller's base URL")
    gateway.add_argument(
        "--gateway-id",
        help="this gateway's name in the controller's reports (default: <hostname>-<pid>)",
    )
    gateway.add_argument(
        "--report-interval", type=duration, default="1s", help="time between load reports to the controller"
    )
    gateway.set_defaults(func=cmd_gateway)


def cmd_controller(args: argparse.Namespace) -> int:
    from stoker.planes import build_controller

    admin_key = _admin_key(args)
    _log_setup(args)
    platform = _platform(args, controller=True, gateway_stale_after_s=args.gateway_stale_after)
    access = _access(args, admin_key, _default_limits_none())
    app = build_controller(platform, access=access, leave_instances=not args.stop_instances_on_exit)
    return _serve(app, args, platform)


def _default_limits_none():
    from stoker.limits import NO_LIMITS

    return NO_LIMITS


def cmd_gateway(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from stoker.gateway import Access
    from stoker.gateway_plane import GatewayPlane
    from stoker.http import own_origins
    from stoker.planes import build_data_gateway

    admin_key = _admin_key(args)
    controller = _controller_url(args.controller)
    _log_setup(args)
    activator_config, limits = _activator_config(args), _default_limits(args)
    gateway_id = args.gateway_id or f"{socket.gethostname()}-{os.getpid()}"
    plane = GatewayPlane(
        controller,
        admin_key,
        gateway_id,
        activator_config,
        CollectorRegistry(),
        report_interval_s=args.report_interval,
    )
    access = Access(admin_key, plane.keys, own_origins(args.host, args.port), limits)
    return _serve(build_data_gateway(plane, access=access), args)


def _controller_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise CLIError(f"--controller must be a base URL like http://controller:8081, got {url!r}")
    return url.rstrip("/")
