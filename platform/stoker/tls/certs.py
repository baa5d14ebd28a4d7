"""A self-signed CA and a server certificate it signs, for one box or a test (`stoker tls init`):
what `--tls-cert`, `--tls-key` and `--tls-ca` take (`stoker.tls`), named as a Kubernetes TLS
Secret's items are (`ca.crt`, `tls.crt`, `tls.key`; the CA's own key `ca.key`).

The server certificate names 127.0.0.1, ::1, localhost and `ENGINE_NAME` (engines are verified by
it), plus whatever names are asked for. Keys are ECDSA P-256, written mode 0600; every file is
written whole to a new temporary file in the directory (created exclusively, never through a
link) and renamed over its name, so a reader sees the old file or the new one, never half of one.
A directory that is a symbolic link is refused. `renew` keeps the CA (its key read back from the
directory) and issues a new server certificate: the peers that trust the CA need nothing new.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from warm_pool.engine_tls import ENGINE_NAME

CA_CERT, CA_KEY, CERT, KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
DEFAULT_NAMES = ("127.0.0.1", "::1", "localhost", ENGINE_NAME)
MAX_NAMES = 100


class CertError(ValueError):
    """A name or a directory `init` cannot use; its message is one line."""


@dataclass(frozen=True)
class Issued:
    directory: Path
    names: tuple[str, ...]
    not_after: datetime.datetime
    renewed: bool  # the CA was kept


def check_name(name: str) -> str:
    """A subjectAltName: an IP address, or a DNS name (a leading `*.` allowed)."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    labels = name.removeprefix("*.").rstrip(".").split(".")
    ok = 0 < len(name) <= 253 and all(
        0 < len(label) <= 63
        and label[0] != "-"
        and label[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        for label in labels
    )
    if not ok:
        raise CertError(f"{name!r} is neither an IP address nor a DNS name")
    return name.lower()


def init(directory: Path, names: Sequence[str] = (), *, days: int = 365, renew: bool = False,
         force: bool = False) -> Issued:  # fmt: skip
    """Write the CA (unless `renew`) and a server certificate for `DEFAULT_NAMES` and `names` into
    `directory` (made, mode 0700, if missing). Refuses to replace a CA already there unless
    `force`: the peers trusting it would stop trusting the new one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not 1 <= days <= 3650:
        raise CertError(f"--days must be 1..3650, got {days}")
    wanted = list(dict.fromkeys([*DEFAULT_NAMES, *(check_name(n) for n in names)]))
    if len(wanted) > MAX_NAMES:
        raise CertError(f"at most {MAX_NAMES} names, got {len(wanted)}")
    dir_fd = _open_dir(directory)
    try:
        now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        start = now - datetime.timedelta(minutes=5)  # a peer whose clock is a little behind
        if renew:
            ca_cert, ca_key = _read_ca(directory, dir_fd)
        else:
            if not force and _exists(CA_KEY, dir_fd):
                raise CertError(f"{directory} already holds a CA ({CA_KEY}): pass --renew to keep it "
                                "and issue a new certificate, or --force to replace it")  # fmt: skip
            ca_key = ec.generate_private_key(ec.SECP256R1())
            ca_name = x509.Name(
                [x509.NameAttribute(NameOID.COMMON_NAME, f"Stoker CA {secrets.token_hex(4)}")]
            )
            ca_cert = (
                x509.CertificateBuilder()
                .subject_name(ca_name)
                .issuer_name(ca_name)
                .public_key(ca_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start)
                .not_valid_after(now + datetime.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256())
            )
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [_general_name(n) for n in wanted]
        not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ENGINE_NAME)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        plain = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        if not renew:
            _write(dir_fd, CA_KEY, ca_key.private_bytes(pem, *plain), 0o600)
            _write(dir_fd, CA_CERT, ca_cert.public_bytes(pem), 0o644)
        _write(dir_fd, KEY, key.private_bytes(pem, *plain), 0o600)
        _write(dir_fd, CERT, cert.public_bytes(pem), 0o644)
    finally:
        os.close(dir_fd)
    return Issued(directory, tuple(wanted), not_after, renew)


def _general_name(name: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _open_dir(directory: Path) -> int:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise CertError(f"{directory} exists and is not a directory") from None
    except OSError as exc:
        raise CertError(f"cannot make {directory}: {exc.strerror or exc}") from None
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(directory):
            raise CertError(f"{directory} is a symbolic link: name the directory itself") from None
        raise CertError(f"cannot open {directory}: {exc.strerror or exc}") from None


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read_private(name: str, dir_fd: int, directory: Path) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CertError(f"--renew: {directory / name} is missing (run `stoker tls init` first)") from None
    except OSError as exc:
        raise CertError(f"--renew: cannot read {directory / name}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CertError(f"--renew: {directory / name} is not a plain file")
        return f.read(1 << 20)


def _read_ca(directory: Path, dir_fd: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(_read_private(CA_CERT, dir_fd, directory))
        key = serialization.load_pem_private_key(_read_private(CA_KEY, dir_fd, directory), password=None)
    except (ValueError, TypeError) as exc:
        raise CertError(f"--renew: the CA in {directory} cannot be read: {exc}") from None
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*der) != key.public_key().public_bytes(*der):
        raise CertError(f"--renew: {directory / CA_KEY} is not the key of {directory / CA_CERT}")
    return cert, key


def _write(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """`data` to a new temporary file beside `name` (exclusive, no link followed, `mode` from its
    creation), synced, then renamed over `name` (a link there is replaced, not followed)."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)
