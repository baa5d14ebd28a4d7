"""The TLS flags every serving command takes (`add_tls_args`, `tls_of`), and `stoker tls init DIR`:
a self-signed CA and a server certificate for one box or a test (`stoker.tls.certs`), what
`--tls-cert DIR/tls.crt --tls-key DIR/tls.key --tls-ca DIR/ca.crt` take. On a cluster the Helm
chart makes its own, or takes a Secret (docs/operations/planes.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from stoker.errors import CLIError


def add_tls_args(p: argparse.ArgumentParser, *, serves: bool = True) -> None:
    """TLS (`stoker.tls`): this process's certificate and key, and the CA its peers are verified
    against. `serves`: the process has a port of its own to serve them on."""
    group = p.add_argument_group("TLS (default: plain HTTP; `stoker tls init DIR` makes a self-signed set)")
    if serves:
        group.add_argument(
            "--tls-cert",
            metavar="FILE",
            help="serve HTTPS with this PEM certificate (chain); a controller's engines serve it too",
        )
        group.add_argument(
            "--tls-key", metavar="FILE", help="the certificate's PEM private key (unencrypted)"
        )
    group.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="the PEM CA bundle the controller and the engines are verified against (always verified)",
    )


def tls_of(args: argparse.Namespace, *, launches_engines: bool):
    """The checked TLS files (`stoker.tls.TlsSettings`), or None; one line naming the flag of a bad one.
    `launches_engines`: the process starts engines, which serve its certificate and are verified
    by its CA, so TLS here means all three files."""
    from stoker.tls import TlsSettings

    cert, key, ca = getattr(args, "tls_cert", None), getattr(args, "tls_key", None), args.tls_ca
    if launches_engines and ca is not None and cert is None:
        raise CLIError(
            "--tls-ca needs --tls-cert and --tls-key here: this process serves them, and its engines too"
        )
    return TlsSettings.load(cert, key, ca, engines=launches_engines)


def register(sub: argparse._SubParsersAction) -> None:
    tls = sub.add_parser("tls", help="TLS between the planes and to the engines: a self-signed set of files")
    commands = tls.add_subparsers(dest="tls_command", required=True, metavar="COMMAND")
    init = commands.add_parser(
        "init",
        help="write a CA (ca.crt, ca.key) and a server certificate it signs (tls.crt, tls.key) into DIR",
    )
    init.add_argument(
        "dir", type=Path, metavar="DIR", help="where the files go (made, mode 0700, if missing)"
    )
    init.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="another name (DNS or IP) the certificate is for, e.g. the controller's host; repeatable "
        "(always: 127.0.0.1, ::1, localhost, stoker-engine)",
    )
    init.add_argument("--days", type=int, default=365, help="how long the server certificate is valid")
    again = init.add_mutually_exclusive_group()
    again.add_argument(
        "--renew",
        action="store_true",
        help="keep DIR's CA and issue a new server certificate (rotation: peers that trust the CA need nothing)",
    )
    again.add_argument("--force", action="store_true", help="replace a CA already in DIR")
    init.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    from stoker.tls.certs import CA_CERT, CERT, KEY, CertError, init

    try:
        issued = init(args.dir, args.san, days=args.days, renew=args.renew, force=args.force)
    except CertError as exc:
        raise CLIError(str(exc)) from None
    d = issued.directory
    what = "a new certificate from the CA kept" if issued.renewed else "a new CA and a certificate"
    print(f"{what} in {d}, for {', '.join(issued.names)}, valid until {issued.not_after:%Y-%m-%d %H:%M} UTC")
    print(f"  --tls-cert {d / CERT} --tls-key {d / KEY} --tls-ca {d / CA_CERT}")
    return 0
