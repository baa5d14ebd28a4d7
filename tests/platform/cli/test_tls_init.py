"""`stoker tls init DIR` (`stoker.tls.certs`): a CA and a server certificate it signs, for the default
names and those asked for; keys mode 0600; files replaced whole, never through a link; a CA kept by
`--renew` and refused to be replaced without `--force`; bad input one line. And the flags of the
planes that take the files refuse wrong combinations in one line, before anything starts."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509

from stoker.cli.main import main
from stoker.tls import TlsSettings
from stoker.tls.certs import CertError, check_name, init
from warm_pool.engine_tls import ENGINE_NAME


def sans(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in alt]


def test_init_writes_a_ca_and_a_certificate_for_the_names(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    issued = init(d, ["Controller.Example", "10.1.2.3", "*.svc.cluster.local"], days=30)
    assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
    assert modes == {"ca.crt": 0o644, "ca.key": 0o600, "tls.crt": 0o644, "tls.key": 0o600}
    names = sans(d / "tls.crt")
    for name in ("127.0.0.1", "::1", "localhost", ENGINE_NAME, "controller.example", "10.1.2.3"):
        assert name in names
    assert "*.svc.cluster.local" in names
    assert issued.names == tuple(dict.fromkeys(issued.names))  # each once
    # What the planes load: signed by the CA, naming the engines.
    assert TlsSettings.load(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"), engines=True).serving
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (
        x509.load_pem_x509_certificate((d / "tls.crt").read_bytes()).not_valid_after_utc == issued.not_after
    )


def test_renew_keeps_the_ca_and_force_replaces_it(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    init(d)
    ca, cert = (d / "ca.crt").read_bytes(), (d / "tls.crt").read_bytes()
    with pytest.raises(CertError, match="already holds a CA"):
        init(d)
    assert init(d, ["new.example"], renew=True).renewed
    assert (d / "ca.crt").read_bytes() == ca and (d / "tls.crt").read_bytes() != cert
    assert "new.example" in sans(d / "tls.crt")
    assert TlsSettings.load(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"), engines=True)
    init(d, force=True)
    assert (d / "ca.crt").read_bytes() != ca
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    with pytest.raises(CertError, match="is missing"):
        init(tmp_path / "empty", renew=True)


def test_no_link_is_followed(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (d / "tls.key").symlink_to(victim)
    init(d)
    assert victim.read_text() == "keep me"  # the link was replaced, not written through
    assert not (d / "tls.key").is_symlink() and stat.S_IMODE((d / "tls.key").stat().st_mode) == 0o600
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(CertError, match="is a symbolic link"):
        init(link, force=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(CertError, match="not a directory"):
        init(tmp_path / "file")


@pytest.mark.parametrize("bad", ["", "a b", "-x.example", "x_y", "ex..ample", "é.example", "a" * 64])
def test_a_bad_name_is_refused(bad: str) -> None:
    with pytest.raises(CertError, match="neither an IP address nor a DNS name"):
        check_name(bad)


def test_names_as_the_certificate_holds_them() -> None:
    assert check_name("::0001") == str(ipaddress.ip_address("::1"))
    assert check_name("Stoker-Controller.NS.svc") == "stoker-controller.ns.svc"


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("stoker: error: ") and err.count("\n") == 1, err
    return err


def test_the_command(tmp_path: Path, capsys) -> None:
    d = tmp_path / "set"
    assert main(["tls", "init", str(d), "--san", "gw.example"]) == 0
    out = capsys.readouterr().out
    assert f"--tls-cert {d / 'tls.crt'} --tls-key {d / 'tls.key'} --tls-ca {d / 'ca.crt'}" in out
    assert "already holds a CA" in _error(capsys, ["tls", "init", str(d)])
    assert "--days must be 1..3650" in _error(capsys, ["tls", "init", str(tmp_path / "x"), "--days", "0"])
    assert "neither an IP" in _error(capsys, ["tls", "init", str(tmp_path / "y"), "--san", "a b"])
    assert not (tmp_path / "y" / "ca.key").exists()


def test_the_planes_flags_refuse_wrong_combinations(tmp_path: Path, capsys, monkeypatch) -> None:
    d, other = tmp_path / "ours", tmp_path / "theirs"
    init(d)
    init(other)
    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STOKER_ADMIN_KEY", "sk-admin-for-the-flag-tests")
    cert, key, ca = (
        ("--tls-cert", str(d / "tls.crt")),
        ("--tls-key", str(d / "tls.key")),
        ("--tls-ca", str(d / "ca.crt")),
    )
    gateway = ["gateway", "--data-dir", str(tmp_path / "gw")]
    assert "is plain HTTP: use https://" in _error(
        capsys, [*gateway, "--controller", "http://127.0.0.1:9", *ca]
    )
    assert "needs --tls-ca" in _error(capsys, [*gateway, "--controller", "https://127.0.0.1:9"])
    wrong_key = ("--tls-key", str(other / "tls.key"))
    assert "is not the key of" in _error(capsys, ["controller", *cert, *wrong_key, *ca])
    assert "--tls-cert needs --tls-ca" in _error(capsys, ["up", *cert, *key])
    assert "--tls-ca needs --tls-cert" in _error(capsys, ["up", *ca])
    assert "not signed by a CA" in _error(capsys, ["up", *cert, *key, "--tls-ca", str(other / "ca.crt")])
    missing = ("--tls-cert", str(tmp_path / "missing.crt"))
    node = ["node", "--store", str(tmp_path), "--controller", "https://c:8081", "--node-name", "n"]
    assert "missing.crt: no such file" in _error(capsys, [*node, *missing, *key, *ca])
    assert "is plain HTTP" in _error(capsys, [*node, "--controller", "http://c:8081", *ca])


def test_the_cli_names_a_ca_it_cannot_read(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STOKER_URL", "https://127.0.0.1:9")
    monkeypatch.setenv("STOKER_CA", str(tmp_path / "nope.crt"))
    assert f"$STOKER_CA {tmp_path / 'nope.crt'}: cannot read a PEM CA bundle" in _error(capsys, ["ls"])
