"""`stoker.tls`: the three files checked at start, each fault one line naming its flag; the
contexts built from them, tried on real TLS handshakes on loopback: a controller is verified by its
host name, an engine by `ENGINE_NAME` whatever address was dialled, and neither by a certificate
another CA signed; the engine's own health check trusts the certificate it serves."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from stoker.errors import CLIError
from stoker.tls import TlsSettings, controller_url, own_server_context
from stoker.tls.certs import init
from warm_pool.engine_tls import ENGINE_NAME, client_ssl, scheme


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tls")
    init(root / "ours")
    init(root / "theirs")
    return root / "ours", root / "theirs"


def load(d: Path, *, key: Path | None = None, ca: Path | None = None, engines: bool = False):
    return TlsSettings.load(
        str(d / "tls.crt"), str(key or d / "tls.key"), str(ca or d / "ca.crt"), engines=engines
    )


def fails(match: str, *args, **kwargs) -> str:
    with pytest.raises(CLIError, match=match) as caught:
        TlsSettings.load(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_nothing_named_is_plain_http() -> None:
    assert TlsSettings.load(None, None, None) is None
    assert scheme(None) == "http" and client_ssl(None) is True


def test_good_files_load_and_serve(sets) -> None:
    ours, _ = sets
    tls = load(ours, engines=True)
    assert tls.serving
    assert tls.server_options() == {
        "ssl_certfile": str(ours / "tls.crt"),
        "ssl_keyfile": str(ours / "tls.key"),
    }
    engine = tls.engine_tls()
    assert engine.engine_args() == (
        "--tls-cert",
        str((ours / "tls.crt").resolve()),
        "--tls-key",
        str((ours / "tls.key").resolve()),
    )
    assert engine.vllm_args()[::2] == ("--ssl-certfile", "--ssl-keyfile")
    assert scheme(engine) == "https" and client_ssl(engine) is tls.engines
    pod = tls.engine_tls("/etc/stoker/engine-tls", "stoker-engine-tls")
    assert (pod.cert, pod.key, pod.secret) == (
        "/etc/stoker/engine-tls/tls.crt",
        "/etc/stoker/engine-tls/tls.key",
        "stoker-engine-tls",
    )
    # A CA alone: a gateway that verifies, and serves plain HTTP.
    only_ca = TlsSettings.load(None, None, str(ours / "ca.crt"))
    assert not only_ca.serving and only_ca.server_options() == {}


def test_each_bad_file_is_one_line_naming_its_flag(sets, tmp_path: Path) -> None:
    ours, theirs = sets
    cert, key, ca = (str(ours / n) for n in ("tls.crt", "tls.key", "ca.crt"))
    fails("--tls-cert and --tls-key go together", cert, None, ca)
    fails(r"--tls-cert .*/nope.crt: no such file", str(tmp_path / "nope.crt"), key, ca)
    fails(r"--tls-ca .*: a directory", cert, key, str(tmp_path))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    fails(r"--tls-cert .*garbage.pem: no PEM certificate", str(garbage), key, ca)
    fails(r"--tls-key .*garbage.pem: not a PEM private key", cert, str(garbage), ca)
    fails(r"--tls-key .*/theirs/tls.key is not the key of the certificate", cert, str(theirs / "tls.key"), ca)
    encrypted = tmp_path / "encrypted.key"
    private = serialization.load_pem_private_key((ours / "tls.key").read_bytes(), None)
    encrypted.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    fails("the key is encrypted", cert, str(encrypted), ca)
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"x" * (2 << 20))
    fails("larger than", cert, key, str(huge))


def test_a_process_that_starts_engines_needs_their_name_and_the_ca(sets, tmp_path: Path) -> None:
    ours, theirs = sets
    cert, key = str(ours / "tls.crt"), str(ours / "tls.key")
    fails("needs --tls-ca", cert, key, None, engines=True)
    fails(r"is not signed by a CA in --tls-ca .*theirs", cert, key, str(theirs / "ca.crt"), engines=True)
    unnamed = _certificate(tmp_path, ours, ["controller.example"])
    fails(f"does not name '{ENGINE_NAME}'", str(unnamed), key, str(ours / "ca.crt"), engines=True)
    # Without engines to start (a gateway), the same certificate is fine.
    assert TlsSettings.load(str(unnamed), key, str(ours / "ca.crt")).serving


def test_the_controller_url_matches_the_tls_settings(sets) -> None:
    ours, _ = sets
    with_ca = TlsSettings.load(None, None, str(ours / "ca.crt"))
    assert controller_url("https://c:8081/", with_ca) == "https://c:8081"
    assert controller_url("http://c:8081", None) == "http://c:8081"
    with pytest.raises(CLIError, match="plain HTTP: use https://"):
        controller_url("http://c:8081", with_ca)
    with pytest.raises(CLIError, match=r"https://… needs --tls-ca"):
        controller_url("https://c:8081", None)
    with pytest.raises(CLIError, match="base URL"):
        controller_url("ftp://c", with_ca)


# -- the contexts, on real handshakes --------------------------------------------------------------


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def serve(sets) -> Iterator:
    """`serve(dir, host)`: an HTTPS server on `host` with dir's certificate; its base URL."""
    servers = []

    def start(d: Path, host: str = "127.0.0.1") -> str:
        server = ThreadingHTTPServer((host, 0), _Ok)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(d / "tls.crt", d / "tls.key")
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"https://{host}:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _get(url: str, context: ssl.SSLContext) -> str:
    async def go() -> str:
        connector = aiohttp.TCPConnector(ssl=context)
        async with aiohttp.ClientSession(connector=connector) as session, session.get(url + "/") as r:
            return f"{r.status}"

    try:
        return asyncio.run(go())
    except aiohttp.ClientConnectorCertificateError as exc:
        return f"refused: {exc.certificate_error}"


def test_a_controller_is_verified_by_its_host_name_and_the_ca(sets, serve) -> None:
    ours, theirs = sets
    tls = TlsSettings.load(None, None, str(ours / "ca.crt"))
    assert _get(serve(ours), tls.client) == "200"
    assert _get(serve(ours).replace("127.0.0.1", "localhost"), tls.client) == "200"
    # An address the certificate does not name (all of 127/8 is loopback), and another CA's.
    assert "IP address mismatch" in _get(serve(ours, "127.0.0.2"), tls.client)
    assert "certificate verify failed" in _get(serve(theirs), tls.client)


def test_an_engine_is_verified_by_its_fixed_name_wherever_it_answers(sets, serve, tmp_path: Path) -> None:
    ours, theirs = sets
    tls = TlsSettings.load(None, None, str(ours / "ca.crt"))
    # 127.0.0.2 is not in the certificate: an engine is checked for ENGINE_NAME, not its address.
    assert _get(serve(ours, "127.0.0.2"), tls.engines) == "200"
    assert "certificate verify failed" in _get(serve(theirs, "127.0.0.2"), tls.engines)
    # A certificate of the same CA without the engines' name is not an engine's.
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    _certificate(unnamed, ours, ["127.0.0.1"], out="tls.crt")
    (unnamed / "tls.key").write_bytes((ours / "tls.key").read_bytes())
    assert "Hostname mismatch" in _get(serve(unnamed), tls.engines)


def test_an_engines_own_health_check_trusts_the_certificate_it_serves(sets, serve) -> None:
    ours, theirs = sets
    url = serve(ours)
    with urllib.request.urlopen(url + "/", timeout=10, context=own_server_context(ours / "tls.crt")) as r:
        assert r.status == 200
    with pytest.raises(OSError, match="certificate verify failed"):
        urllib.request.urlopen(url + "/", timeout=10, context=own_server_context(theirs / "tls.crt"))


def _certificate(where: Path, signer: Path, names: list[str], out: str = "other.crt") -> Path:
    """A certificate for `signer`'s server key, signed by its CA, naming only `names`."""
    import ipaddress

    ca_key = serialization.load_pem_private_key((signer / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((signer / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((signer / "tls.key").read_bytes(), None)
    alt = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    path = where / out
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path
