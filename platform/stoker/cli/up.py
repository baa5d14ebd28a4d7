"""`stoker up`, and the options every serving process shares with it (`stoker controller`,
`stoker gateway`: `stoker.cli.planes`): where it serves, its admin key, how its activators hold
and proxy, how its pools scale and share devices, the default limits of tenant keys.

`up` runs both planes in one process, in the foreground: the gateway, the activators, the pools.
"""

from __future__ import annotations

import argparse
import os

from activator.config import ActivatorConfig
from stoker.cli.parser import duration_or_off, port
from stoker.cli.pool_flags import add_pool_args, platform_settings
from stoker.cli.tls import add_tls_args, tls_of
from stoker.errors import CLIError
from stoker.paths import add_store_args
from stoker.spec.durations import duration, format_duration


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run the platform (gateway, activators, warm pools) in the foreground")
    for add in (
        add_serve_args,
        add_activator_args,
        add_pool_args,
        add_limit_args,
        add_request_log_args,
        add_batch_args,
    ):
        add(up)
    add_store_args(up)
    up.set_defaults(func=cmd_up)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Where a process serves, and its log."""
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=port, default=8080, help="port to serve on")
    p.add_argument(
        "--allow-open",
        action="store_true",
        help="serve a non-loopback address without STOKER_ADMIN_KEY (anyone who reaches it is admin)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the log shows",
    )
    add_tls_args(p)  # stoker.cli.tls


def add_activator_args(p: argparse.ArgumentParser) -> None:
    """The activator's: how requests are held, proxied, and sick instances ejected. Their defaults
    are `ActivatorConfig`'s, written there once."""
    A = ActivatorConfig
    p.add_argument(
        "--hold-deadline",
        type=duration,
        default=format_duration(A.hold_deadline_s),
        help="how long a request may wait for capacity (longer where the start it waits on is expected "
        "to take longer: --hold-deadline-max)",
    )
    p.add_argument(
        "--hold-deadline-max",
        type=duration,
        default=format_duration(A.hold_deadline_max_s),
        help="the longest a request is held for a start measured to be slow: 1.5x the start's "
        "expected seconds, up to this (the same as --hold-deadline: a fixed hold)",
    )
    p.add_argument(
        "--max-queued", type=int, default=A.max_queued, help="requests held per deployment at once"
    )
    p.add_argument(
        "--max-body-memory",
        metavar="SIZE",
        help="request bodies read and not yet answered, in all; a request whose body does not fit is "
        "refused at once (503 server_overloaded, Retry-After), unread (default: 256MiB)",
    )
    p.add_argument(
        "--keepalive-interval",
        type=duration_or_off,
        default=format_duration(A.keepalive_interval_s),
        help="time between the keep-alives (blank lines) a held stream gets; 0 or off: none, and a held "
        "stream's headers wait for its answer",
    )
    p.add_argument(
        "--plain-keepalive",
        type=duration_or_off,
        default="off",
        help="a held non-stream request gets a 200 at once and a space this often, which proxies with "
        "short idle timeouts let through; a later failure then comes in the 200's body, not as a status "
        "(off: nothing until the answer, whose status is its own)",
    )
    p.add_argument(
        "--first-byte-timeout",
        type=duration,
        default=format_duration(A.first_byte_timeout_s),
        help="how long a plain request waits for its whole answer's headers",
    )
    p.add_argument(
        "--stream-headers-timeout",
        type=duration,
        default=format_duration(A.stream_headers_timeout_s),
        help="how long a stream waits for an instance's headers before it is retried elsewhere",
    )
    p.add_argument(
        "--eject-after",
        type=int,
        default=A.eject_after,
        help="failures in a row that take an instance out of routing",
    )
    p.add_argument(
        "--eject-time",
        type=duration,
        default=format_duration(A.eject_base_s),
        help="how long the first ejection lasts; doubled on each one in a row, up to 300 s",
    )
    p.add_argument(
        "--replace-after-ejections",
        type=int,
        default=A.replace_after_ejections,
        help="ejections in a row after which an instance is replaced as stopped or wedged",
    )
    p.add_argument(
        "--health-interval",
        type=duration,
        default=format_duration(A.health_interval_s),
        help="time between probes of each instance's /health",
    )
    p.add_argument(
        "--health-timeout",
        type=duration,
        default=format_duration(A.health_timeout_s),
        help="how long a /health probe may take",
    )


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Default limits of tenant keys."""
    limits = p.add_argument_group("limits of tenant keys that set none of their own (default: none)")
    limits.add_argument("--key-rps", type=float, metavar="R", help="requests per second per key")
    limits.add_argument(
        "--key-tpm", type=int, metavar="T", help="tokens (prompt + completion) per minute per key"
    )
    limits.add_argument(
        "--key-max-concurrent", type=int, metavar="N", help="requests held + in flight at once per key"
    )


def add_request_log_args(p: argparse.ArgumentParser) -> None:
    """The request log and drift (`stoker.gateway.request_log`, `stoker.gateway.drift`)."""
    group = p.add_argument_group("request log and drift")
    group.add_argument(
        "--request-log",
        action="store_true",
        help="log every deployment's requests, de-identified, to $STOKER_HOME/request-log/requests.jsonl "
        "(default: only deployments deployed with log_requests or log_content)",
    )
    group.add_argument(
        "--request-log-size", metavar="SIZE", default="64MiB", help="the log's size before it is rotated"
    )
    group.add_argument(
        "--request-log-files", type=int, default=4, metavar="N", help="rotated log files kept (1..100)"
    )
    group.add_argument(
        "--drift-window", type=duration, default="5m", help="the window drift statistics are compared over"
    )
    group.add_argument(
        "--drift-min-requests",
        type=int,
        default=20,
        metavar="N",
        help="answers a window needs to be scored or to be the reference",
    )


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The batch API's (`stoker.batch.config.BatchConfig`, where the defaults are written)."""
    from stoker.batch.config import BatchConfig

    group = p.add_argument_group("batch API (/v1/files, /v1/batches)")
    group.add_argument(
        "--upload-limit", metavar="SIZE", default="200MiB", help="the largest file /v1/files takes"
    )
    group.add_argument(
        "--files-store",
        metavar="S3_URI",
        help="keep the files' bytes in object storage (s3://bucket/prefix; endpoint from "
        "AWS_ENDPOINT_URL), not in the data dir",
    )
    group.add_argument(
        "--batch-share",
        type=float,
        default=BatchConfig.share,
        metavar="F",
        help="the fraction of a deployment's awake slots batch requests may fill, interactive ones counted",
    )
    group.add_argument(
        "--batch-concurrency",
        type=int,
        default=BatchConfig.concurrency,
        metavar="N",
        help="requests of one batch in flight at most",
    )


def batch_config(args: argparse.Namespace):
    from snapshots.errors import RemoteError
    from snapshots.sizes import parse_size
    from stoker.batch.config import BatchConfig

    try:
        return BatchConfig(
            upload_limit_bytes=parse_size(args.upload_limit),
            share=args.batch_share,
            concurrency=args.batch_concurrency,
            files_store=args.files_store,
        )
    except RemoteError as exc:
        raise CLIError(f"--files-store: {exc}") from None
    except ValueError as exc:
        raise CLIError(f"--upload-limit/--batch-share/--batch-concurrency: {exc}") from None


def request_logging(args: argparse.Namespace):
    """The request log's, drift's and traces' settings (`stoker.serve.options.RequestLogging`)."""
    from snapshots.sizes import parse_size
    from stoker.gateway import otel  # imports no OpenTelemetry package unless an endpoint is set
    from stoker.gateway.drift import Drift
    from stoker.gateway.request_log import RequestLogFile
    from stoker.serve.options import RequestLogging

    try:
        size = parse_size(args.request_log_size)
    except ValueError as exc:
        raise CLIError(f"--request-log-size: {exc}") from None
    try:
        RequestLogFile.check(size, args.request_log_files)
    except ValueError as exc:
        raise CLIError(f"--request-log-size/--request-log-files: {exc}") from None
    try:
        Drift.check(args.drift_window, args.drift_min_requests)
    except ValueError as exc:
        raise CLIError(f"--drift-window/--drift-min-requests: {exc}") from None
    tracing = None
    if otel.wanted():
        try:
            tracing = otel.tracing_from_env()
        except otel.TracingUnavailable as exc:
            raise CLIError(str(exc)) from None
    return RequestLogging(
        size, args.request_log_files, args.request_log, args.drift_window, args.drift_min_requests, tracing
    )


def listen_of(args: argparse.Namespace, *, launches_engines: bool = True):
    """Where the process serves, its admin key (`STOKER_ADMIN_KEY`) and its TLS (`tls_of`); a
    non-loopback address needs a key, or `--allow-open`."""
    from stoker.http import is_loopback
    from stoker.serve.options import Listen

    admin_key = os.environ.get("STOKER_ADMIN_KEY") or None
    if admin_key is None and not is_loopback(args.host) and not args.allow_open:
        raise CLIError(
            f"refusing to serve {args.host} without STOKER_ADMIN_KEY (anyone reaching it could deploy "
            "and call models): set STOKER_ADMIN_KEY, or pass --allow-open"
        )
    return Listen(
        args.host, args.port, args.log_level, admin_key, tls=tls_of(args, launches_engines=launches_engines)
    )


def activator_config(args: argparse.Namespace):
    from activator import ActivatorConfig

    try:
        return ActivatorConfig(
            max_queued=args.max_queued,
            hold_deadline_s=args.hold_deadline,
            hold_deadline_max_s=max(args.hold_deadline_max, args.hold_deadline),
            keepalive_interval_s=args.keepalive_interval,
            plain_keepalive_interval_s=args.plain_keepalive,
            first_byte_timeout_s=args.first_byte_timeout,
            stream_headers_timeout_s=args.stream_headers_timeout,
            eject_after=args.eject_after,
            eject_base_s=args.eject_time,
            eject_max_s=max(ActivatorConfig.eject_max_s, args.eject_time),
            replace_after_ejections=args.replace_after_ejections,
            health_interval_s=args.health_interval,
            health_timeout_s=args.health_timeout,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def default_limits(args: argparse.Namespace):
    from stoker.errors import APIError
    from stoker.spec.keys import Limits

    try:
        return Limits.parse(
            {"rps": args.key_rps, "tpm": args.key_tpm, "max_concurrent": args.key_max_concurrent}, "key_"
        )
    except APIError as exc:
        raise CLIError(exc.message.replace("'key_", "'--key-").replace("_", "-")) from None


def cmd_up(args: argparse.Namespace) -> int:
    from stoker.serve.options import UpOptions
    from stoker.serve.up import run_up

    listen = listen_of(args)
    options = UpOptions(
        listen,
        platform_settings(args),
        activator_config(args),
        default_limits(args),
        request_logging(args),
        batch_config(args),
        body_memory_bytes=body_memory(args),
    )
    return run_up(options)


def body_memory(args: argparse.Namespace) -> int | None:
    """`--max-body-memory` in bytes, at least the one body limit (4 MiB), or one line naming it;
    None when not given (`stoker.gateway.body_budget.BODY_MEMORY_BYTES`)."""
    from snapshots.sizes import parse_size
    from stoker.http import MAX_REQUEST_BYTES

    if args.max_body_memory is None:
        return None
    try:
        size = parse_size(args.max_body_memory)
    except ValueError as exc:
        raise CLIError(f"--max-body-memory: {exc}") from None
    if size < MAX_REQUEST_BYTES:
        raise CLIError(
            f"--max-body-memory must be at least the 4MiB one body may take, got {args.max_body_memory!r}"
        )
    return size
