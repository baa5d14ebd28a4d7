"""The CLI's side of the admin API: where the platform is, and one call or one stream to it.

The address is `--url`, else `$STOKER_URL`, else http://127.0.0.1:8080; `$STOKER_ADMIN_KEY`, when
set, is sent as the bearer key. An https:// address (here, and for `stoker eval` and `stoker
bench`) is verified against `$STOKER_CA` (a PEM CA bundle, e.g. `stoker tls init`'s ca.crt) when
set, else the system's CAs. Every failure is a `CLIError` of one line: the platform's own message
for an HTTP error (OpenAI's error shape), or that it cannot be reached and where it was looked for.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import BinaryIO

from stoker.errors import CLIError

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "STOKER_URL"
CA_ENV = "STOKER_CA"
CALL_TIMEOUT_S = 600  # a deploy imports a model directory before it answers


def add_url_args(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """`--url` on a command, and (`top`) on `stoker` itself, so it may come before the command as
    kubectl's global flags do. The command's own leaves the namespace alone when it is not given
    (`SUPPRESS`), so a `--url` given before the command stands; given after, it wins."""
    parser.add_argument(
        "--url",
        metavar="URL",
        default=None if top else argparse.SUPPRESS,
        help=f"the platform's address (default: ${URL_ENV}, else {DEFAULT_URL})",
    )


def base_url(args: argparse.Namespace) -> str:
    url = (getattr(args, "url", None) or os.environ.get(URL_ENV) or DEFAULT_URL).strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        where = "--url" if getattr(args, "url", None) else f"${URL_ENV}"
        raise CLIError(f"{where}: {url!r} is not an http:// or https:// address, e.g. {DEFAULT_URL}")
    return url


def call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One admin API call; its JSON answer."""
    with _open(args, method, path, body, CALL_TIMEOUT_S) as response:
        return json.loads(response.read())


def text(args: argparse.Namespace, path: str) -> str:
    """One admin API read whose answer is text (`/metrics`)."""
    with _open(args, "GET", path, None, CALL_TIMEOUT_S) as response:
        return response.read().decode("utf-8", "replace")


def stream(args: argparse.Namespace, path: str, out: BinaryIO, *, follow: bool) -> None:
    """Copy a text answer to `out` as it arrives (a follow has no timeout: it ends when the server
    ends it, or on Ctrl-C). A reader that went away (`| head`) ends it quietly."""
    try:
        with _open(args, "GET", path, None, None if follow else CALL_TIMEOUT_S) as response:
            while chunk := response.read1(64 << 10):
                out.write(chunk)
                out.flush()
    except BrokenPipeError:
        # Python would complain again at exit, flushing the same broken stdout: point it elsewhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, http.client.HTTPException) as exc:  # the platform went away mid-answer
        raise CLIError(f"the platform at {base_url(args)} broke off the answer ({exc!r})") from None


def _open(args: argparse.Namespace, method: str, path: str, body: dict | None, timeout: float | None):
    base = base_url(args)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"}
    if admin_key := os.environ.get("STOKER_ADMIN_KEY"):
        headers["authorization"] = f"Bearer {admin_key}"
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=timeout, context=tls_context())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise CLIError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CLIError(f"cannot reach the platform at {base} ({reason}); is `stoker up` running?") from None


def tls_context():
    """`$STOKER_CA`'s context for an https:// platform; None: the system's CAs (or plain HTTP)."""
    ca = os.environ.get(CA_ENV)
    if not ca:
        return None
    import ssl

    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise CLIError(f"${CA_ENV} {ca}: cannot read a PEM CA bundle from it ({exc})") from None
