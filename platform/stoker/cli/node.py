"""`stoker node`: the node agent a Kubernetes DaemonSet runs on every GPU node (`stoker.node.agent`).

    STOKER_ADMIN_KEY=... stoker node --store /var/lib/stoker/snapshots --controller http://stoker-controller:8081 \\
        --node-name "$NODE_NAME" [--host 0.0.0.0] [--port 8082] [--interval 30s] [--no-warm] [--kubeconfig PATH]

It asks the controller with the admin key which snapshots deployments use, pulls the missing ones
from S3 into the store (credentials and endpoint from the standard AWS chain and
`AWS_ENDPOINT_URL`), and labels its own Node object with what the store holds. It reaches the
Kubernetes API with the pod's service account unless `--kubeconfig` names a file. `/healthz` is
open (for the kubelet's probes); `/metrics` takes the admin key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from stoker.cli.parser import port
from stoker.errors import CLIError
from stoker.spec.durations import duration

if TYPE_CHECKING:
    import uvicorn
    from lightkube import KubeConfig

    from stoker.node.agent import AgentConfig, NodeAgent

# lightkube, aiohttp and aiobotocore are imported inside the command: `stoker --help` stays instant.


def register(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser(
        "node", help="run the node agent: pull the snapshots deployments use, label the node with them"
    )
    node.add_argument("--store", required=True, metavar="DIR", help="this node's snapshot store (a hostPath)")
    node.add_argument(
        "--controller",
        required=True,
        metavar="URL",
        help="the controller, e.g. https://stoker-controller:8081 (with --tls-ca)",
    )
    node.add_argument(
        "--node-name",
        required=True,
        metavar="NAME",
        help="this node's name in Kubernetes (the downward API's spec.nodeName)",
    )
    node.add_argument("--host", default="0.0.0.0", help="address to serve /healthz and /metrics on")
    node.add_argument("--port", type=port, default=8082, help="port to serve /healthz and /metrics on")
    node.add_argument("--interval", type=duration, default="30s", help="time between syncs")
    node.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read each pulled snapshot into the page cache, so the first start on this node loads at memory speed",
    )
    node.add_argument(
        "--kubeconfig", metavar="PATH", help="a kubeconfig file (default: the pod's service account)"
    )
    from stoker.cli.tls import add_tls_args

    add_tls_args(node)  # its own /healthz and /metrics on HTTPS; the controller verified against the CA
    node.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the log shows",
    )
    node.set_defaults(func=cmd_node)


def cmd_node(args: argparse.Namespace) -> int:
    from stoker.node.agent import AgentConfig
    from stoker.tls import TlsSettings, controller_url

    admin_key = os.environ.get("STOKER_ADMIN_KEY", "")
    if not admin_key:
        raise CLIError(
            "STOKER_ADMIN_KEY is not set: `stoker node` asks the controller with it, and /metrics requires it"
        )
    tls = TlsSettings.load(args.tls_cert, args.tls_key, args.tls_ca)
    try:
        config = AgentConfig(controller_url(args.controller, tls), args.node_name, args.interval, args.warm)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    kube_config = _kube_config(args.kubeconfig)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # uvicorn re-raises SIGTERM once it has drained; ignored, a clean stop exits 0 (stoker.http.run_server).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        asyncio.run(_main(args, config, kube_config, admin_key, tls))
    except SystemExit:  # uvicorn's startup exits this way when it cannot bind, having logged why
        raise CLIError(f"could not serve on {args.host}:{args.port}") from None
    return 0


async def _main(
    args: argparse.Namespace, config: AgentConfig, kube_config: KubeConfig, admin_key: str, tls=None
) -> None:
    """Build the agent and its server inside the event loop (lightkube's client belongs to one), and
    run both."""
    from lightkube import AsyncClient

    from snapshots import SnapshotStore
    from snapshots.remote import RemoteConfig
    from stoker.http import make_server
    from stoker.node.agent import NodeAgent, build_app

    kube = AsyncClient(config=kube_config)
    try:
        store = SnapshotStore(Path(args.store))
        agent = NodeAgent(config, store, kube, RemoteConfig.from_env(), admin_key, tls=tls)
        app = build_app(agent, admin_key)
        server = make_server(
            app, host=args.host, port=args.port, log_level=args.log_level, grace_period_s=5, tls=tls
        )
        await serve_node(agent, server)
    finally:
        await kube.close()


def _kube_config(path: str | None) -> KubeConfig:
    """The kubeconfig at `path`, else the pod's service account; a CLIError saying which failed."""
    from lightkube import KubeConfig
    from lightkube.core.exceptions import ConfigError

    try:
        return KubeConfig.from_file(path) if path else KubeConfig.from_service_account()
    except (ConfigError, OSError) as exc:
        where = (
            f"--kubeconfig {path}" if path else "the pod's service account (outside a pod, give --kubeconfig)"
        )
        raise CLIError(f"cannot read {where}: {exc}") from None


async def serve_node(agent: NodeAgent, server: uvicorn.Server) -> None:
    """Run the agent's sync loop beside its HTTP server; the server's exit (SIGTERM, Ctrl-C) ends both."""
    syncing = asyncio.create_task(agent.run())
    try:
        await server.serve()
    finally:
        syncing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await syncing
