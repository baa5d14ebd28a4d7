"""`stoker tls init DIR`: a self-signed CA and a server certificate for one box or a test
(`stoker.tls.certs`), what `--tls-cert DIR/tls.crt --tls-key DIR/tls.key --tls-ca DIR/ca.crt` take.
On a cluster the Helm chart makes its own, or takes a Secret (docs/operations/planes.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from stoker.errors import CLIError


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
