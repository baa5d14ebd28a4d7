"""TLS between the planes and to the engines, from three files: a server certificate (chain) and
its key, and the CA bundle peers are verified against (`--tls-cert`, `--tls-key`, `--tls-ca`).

`TlsSettings.load` reads and checks them once, at start, each failure one line naming its flag (a
file missing or unreadable, not PEM, an encrypted key, a key that is not the certificate's, a
certificate the CA did not sign); then every process builds its contexts from it, once:

    server        uvicorn serves HTTPS with the certificate and key (`server_options`)
    client        verifies a controller: chain to the CA and the URL's host name (`client`)
    engines       verifies an engine: chain to the CA and the fixed name `ENGINE_NAME`, whatever
                  address was dialled (a port or pod IP known only once it runs) (`engines`)

Verification is never switched off: there is no flag that would. Without any of the files a
process speaks plain HTTP, as before.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from stoker.errors import CLIError
from warm_pool.engine_tls import ENGINE_NAME, EngineTls

MAX_PEM_BYTES = 1 << 20  # a chain or a CA bundle; anything larger is not one


class _NamedPeer(ssl.SSLContext):
    """A client context that checks the peer's certificate for `peer_name` whatever host it dialled:
    asyncio (and uvloop) wrap every TLS connection with `wrap_bio`, handed the dialled host."""

    peer_name: str = ENGINE_NAME

    def wrap_bio(self, incoming, outgoing, server_side=False, server_hostname=None, session=None):
        return super().wrap_bio(incoming, outgoing, server_side, self.peer_name, session)

    def wrap_socket(self, sock, server_side=False, do_handshake_on_connect=True, suppress_ragged_eofs=True,
                    server_hostname=None, session=None):  # fmt: skip
        return super().wrap_socket(
            sock, server_side, do_handshake_on_connect, suppress_ragged_eofs, self.peer_name, session
        )


def _client_context(ca: Path, cls: type[ssl.SSLContext] = ssl.SSLContext) -> ssl.SSLContext:
    context = cls(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname, by this protocol
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=str(ca))
    return context


@dataclass(frozen=True)
class TlsSettings:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def load(
        cls, cert: str | None, key: str | None, ca: str | None, *, engines: bool = False
    ) -> TlsSettings | None:
        """The checked settings, or None when no file is named (plain HTTP). `engines`: the
        certificate is also what the engines this process launches serve, so it must carry
        `ENGINE_NAME` and be signed by the CA the process verifies them with."""
        if cert is None and key is None and ca is None:
            return None
        if (cert is None) != (key is None):
            raise CLIError("--tls-cert and --tls-key go together: the certificate and its private key")
        settings = cls(*(Path(p) if p is not None else None for p in (cert, key, ca)))
        settings.check(engines=engines)
        return settings

    @property
    def serving(self) -> bool:
        return self.cert is not None

    def check(self, *, engines: bool = False) -> None:
        """A CLIError naming the flag of the first file that is wrong."""
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization

        authorities = _certificates("--tls-ca", self.ca) if self.ca is not None else []
        if self.cert is None:
            return
        chain = _certificates("--tls-cert", self.cert)
        data = _read("--tls-key", self.key)
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except TypeError:
            raise CLIError(
                f"--tls-key {self.key}: the key is encrypted; give it unencrypted (mode 0600)"
            ) from None
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise CLIError(f"--tls-key {self.key}: not a PEM private key ({type(exc).__name__})") from None
        der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if private.public_key().public_bytes(*der) != chain[0].public_key().public_bytes(*der):
            raise CLIError(
                f"--tls-key {self.key} is not the key of the certificate in --tls-cert {self.cert}"
            )
        if engines:
            if self.ca is None:
                raise CLIError("--tls-cert needs --tls-ca: the engines this process starts serve the "
                               "certificate, and are verified against that CA")  # fmt: skip
            if ENGINE_NAME not in _dns_names(chain[0]):
                raise CLIError(f"--tls-cert {self.cert} does not name {ENGINE_NAME!r} (a DNS name in its "
                               "subjectAltName): engines serve it and are verified by that name")  # fmt: skip
            if not _issued_by_one_of(chain, authorities):
                raise CLIError(f"--tls-cert {self.cert} is not signed by a CA in --tls-ca {self.ca}")

    def server_options(self) -> dict[str, str]:
        """uvicorn's: HTTPS with the certificate (none: plain HTTP)."""
        if self.cert is None:
            return {}
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}

    @cached_property
    def client(self) -> ssl.SSLContext:
        """Verifies a controller (by its URL's host name) against the CA."""
        return _client_context(self._ca("a controller"))

    @cached_property
    def engines(self) -> ssl.SSLContext:
        """Verifies an engine (by `ENGINE_NAME`) against the CA."""
        return _client_context(self._ca("an engine"), _NamedPeer)

    def engine_tls(self, mount: str | None = None, secret: str | None = None) -> EngineTls:
        """What the backend launches engines with: this certificate, or on Kubernetes the pod's
        mount (`mount`) of `secret`."""
        if mount is not None:
            return EngineTls(f"{mount}/tls.crt", f"{mount}/tls.key", self.engines, secret)
        if self.cert is None:
            raise CLIError("engines serve TLS only with --tls-cert and --tls-key")
        return EngineTls(str(self.cert.resolve()), str(self.key.resolve()), self.engines)

    def _ca(self, peer: str) -> Path:
        if self.ca is None:
            raise CLIError(f"verifying {peer} over TLS needs --tls-ca (the CA that signed its certificate)")
        return self.ca


def controller_url(url: str, tls: TlsSettings | None, flag: str = "--controller") -> str:
    """The controller's base URL, checked against the TLS settings: an https:// one is verified
    against --tls-ca, and with a CA given a plain http:// one is refused (the routing table carries
    the engines' keys, and the admin key goes with every call)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise CLIError(f"{flag} must be a base URL like http://controller:8081, got {url!r}")
    has_ca = tls is not None and tls.ca is not None
    if parts.scheme == "https" and not has_ca:
        raise CLIError(f"{flag} https://… needs --tls-ca: the CA that signed the controller's certificate")
    if parts.scheme == "http" and has_ca:
        raise CLIError(f"--tls-ca is set but {flag} {url} is plain HTTP: use https://, the routing "
                       "table carries the engines' keys")  # fmt: skip
    return url.rstrip("/")


def own_server_context(cert: Path) -> ssl.SSLContext:
    """Verifies this machine's own engine (`stoker vllm-serve`'s health check) by the certificate it
    serves, trusted as it is, and `ENGINE_NAME`: no CA is at hand there, and none is needed."""
    context = _NamedPeer(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.load_verify_locations(cafile=str(cert))
    return context


def client_context(tls: TlsSettings | None) -> ssl.SSLContext | bool:
    """aiohttp's `ssl=` for calls to the controller: the CA's context, or aiohttp's default."""
    return True if tls is None or tls.ca is None else tls.client


def engines_context(tls: TlsSettings | None) -> ssl.SSLContext | bool:
    """aiohttp's `ssl=` for calls to engines."""
    return True if tls is None or tls.ca is None else tls.engines


def _read(flag: str, path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise CLIError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise CLIError(f"{flag} {path}: a directory, not a file") from None
    except OSError as exc:
        raise CLIError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_PEM_BYTES:
        raise CLIError(f"{flag} {path}: larger than {MAX_PEM_BYTES} bytes, not a PEM file")
    return data


def _certificates(flag: str, path: Path) -> list:
    from cryptography import x509

    data = _read(flag, path)
    try:
        found = x509.load_pem_x509_certificates(data)
    except ValueError:
        found = []
    if not found:
        raise CLIError(f"{flag} {path}: no PEM certificate in it")
    return found


def _dns_names(cert) -> list[str]:
    from cryptography import x509

    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return names.get_values_for_type(x509.DNSName)


def _issued_by_one_of(chain: list, authorities: list) -> bool:
    """Whether the chain's last certificate is one of `authorities` or was signed by one."""
    from cryptography.exceptions import InvalidSignature

    last = chain[-1]
    for ca in authorities:
        if last == ca:
            return True
        try:
            last.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):  # not this one
            continue
    return False
