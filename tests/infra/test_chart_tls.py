"""The chart's TLS (values.yaml: tls), rendered with helmlite: on by default, the controller serving
HTTPS with a certificate the chart makes (genCA, genSignedCert) for its Service's names, the engine
pods with their own (stoker-engine), both signed by one CA whose certificate alone the gateways and
node agents get; the files load as the planes load them (`stoker.tls`). A Secret the user names is
used instead and none is made; an upgrade keeps the chart's own (lookup); off, everything is plain
HTTP as before."""

from __future__ import annotations

import base64
from pathlib import Path

import kubernetes_validate
import pytest

from stoker.tls import TlsSettings
from tests.infra.helmlite import manifests, render_chart
from tests.infra.test_chart import CHART, DEFAULTS, KUBERNETES, NAMESPACE, container, one, render
from warm_pool.engine_tls import ENGINE_NAME


def tls_secrets(objects: list[dict]) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] == "Secret" and o["type"] == "kubernetes.io/tls"
    }


def files(secret: dict, where: Path) -> dict[str, str]:
    """The Secret's items as files, as a pod's volume holds them."""
    where.mkdir(parents=True, exist_ok=True)
    out = {}
    for item, data in secret["data"].items():
        (where / item).write_bytes(base64.b64decode(data))
        out[item] = str(where / item)
    return out


def volume(workload: dict, name: str = "tls") -> dict:
    (found,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return found


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(DEFAULTS)


def test_tls_is_on_by_default_with_certificates_the_chart_makes(objects, tmp_path: Path) -> None:
    secrets = tls_secrets(objects)
    assert sorted(secrets) == ["stoker-engine-tls", "stoker-tls"]
    for secret in secrets.values():
        kubernetes_validate.validate(secret, KUBERNETES, strict=True)
        assert "ca.key" not in secret["data"]  # the CA's key is never kept: nothing more can be signed
    server = files(secrets["stoker-tls"], tmp_path / "controller")
    engine = files(secrets["stoker-engine-tls"], tmp_path / "engine")
    assert sorted(server) == ["ca.crt", "tls.crt", "tls.key"] and sorted(engine) == ["tls.crt", "tls.key"]
    # As the controller loads its own (the kubernetes backend: engine pods serve theirs) ...
    TlsSettings.load(server["tls.crt"], server["tls.key"], server["ca.crt"])
    # ... and the engine pods' certificate is one the same CA signed for the engines' name.
    TlsSettings.load(engine["tls.crt"], engine["tls.key"], server["ca.crt"], engines=True)
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(server["tls.crt"]).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    service = one(objects, "Service", "controller")["metadata"]["name"]
    assert service in names.get_values_for_type(x509.DNSName)
    assert f"{service}.{NAMESPACE}.svc" in names.get_values_for_type(x509.DNSName)
    assert ENGINE_NAME not in names.get_values_for_type(x509.DNSName)  # an engine pod cannot pose as it


def test_each_pod_mounts_only_what_it_needs_read_only(objects) -> None:
    controller = one(objects, "Deployment", "controller")
    args = container(controller)["args"]
    assert args[args.index("--engine-tls-secret") + 1] == "stoker-engine-tls"
    assert [i["key"] for i in volume(controller)["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
    for workload in (one(objects, "Deployment", "gateway"), one(objects, "DaemonSet", "node")):
        c = container(workload)
        assert c["args"][c["args"].index("--controller") + 1].startswith("https://")
        assert [i["key"] for i in volume(workload)["secret"]["items"]] == ["ca.crt"]  # no key of anyone's
        assert volume(workload)["secret"]["secretName"] == "stoker-tls"
    for workload in (controller, one(objects, "Deployment", "gateway"), one(objects, "DaemonSet", "node")):
        c = container(workload)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": "/etc/stoker/tls", "readOnly": True}
        flags = [a for a in c["args"] if a.startswith("--tls-")]
        paths = [c["args"][c["args"].index(f) + 1] for f in flags]
        assert all(p.startswith("/etc/stoker/tls/") for p in paths)
        assert volume(workload)["secret"]["defaultMode"] == 0o440


def test_a_named_secret_is_used_and_none_is_made() -> None:
    objects = render({**DEFAULTS, "tls": {"existingSecret": "corp-tls"}})
    assert tls_secrets(objects) == {}
    controller = one(objects, "Deployment", "controller")
    args = container(controller)["args"]
    assert volume(controller)["secret"]["secretName"] == "corp-tls"
    assert args[args.index("--engine-tls-secret") + 1] == "corp-tls"  # engines serve it too, by default
    assert volume(one(objects, "Deployment", "gateway"))["secret"]["secretName"] == "corp-tls"
    objects = render(
        {**DEFAULTS, "tls": {"existingSecret": "corp-tls", "existingEngineSecret": "corp-engines"}}
    )
    args = container(one(objects, "Deployment", "controller"))["args"]
    assert args[args.index("--engine-tls-secret") + 1] == "corp-engines"


def test_an_upgrade_keeps_the_chart_s_certificates() -> None:
    first = tls_secrets(render(DEFAULTS))
    cluster = [{**s, "metadata": {**s["metadata"], "namespace": NAMESPACE}} for s in first.values()]
    again = tls_secrets(
        manifests(render_chart(CHART, DEFAULTS, release="stoker", namespace=NAMESPACE, cluster=cluster))
    )
    assert {n: s["data"] for n, s in again.items()} == {n: s["data"] for n, s in first.items()}
    # Without them (an install, or after they were deleted to rotate them): new ones.
    assert tls_secrets(render(DEFAULTS))["stoker-tls"]["data"] != first["stoker-tls"]["data"]


def test_tls_off_is_plain_http_everywhere() -> None:
    objects = render({**DEFAULTS, "tls": {"enabled": False}, "serviceMonitor": {"enabled": True}})
    assert tls_secrets(objects) == {}
    for kind, component in (("Deployment", "controller"), ("Deployment", "gateway"), ("DaemonSet", "node")):
        workload = one(objects, kind, component)
        c = container(workload)
        assert not [a for a in c["args"] if a.startswith(("--tls-", "--engine-tls"))]
        assert "https://" not in " ".join(c["args"])
        assert "scheme" not in c["readinessProbe"]["httpGet"]
        assert "tls" not in [v["name"] for v in workload["spec"]["template"]["spec"]["volumes"]]
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["controller", "gateway"]
