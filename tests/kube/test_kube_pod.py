"""The pod and Secret manifests: valid against the API's schemas, secrets only by reference."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest

from warm_pool.backends.base import Placement
from warm_pool.backends.kube_pod import (
    PodSettings,
    bind_anywhere,
    pod_manifest,
    secret_manifest,
    snapshot_label,
)
from warm_pool.launch import cpu_engine_spec, vllm_spec

SNAPSHOT = "ab" * 32
KEY = "sk-instance-key-0123456789"
SETTINGS = PodSettings(image="stoker-engine:1", store_path="/var/lib/stoker/snapshots", owner="ctl-1")


def placement(gpus: int, uri: str | None) -> Placement:
    return Placement(
        "chat-1a2b3c4d", "chat", SNAPSHOT, uri, "vllm" if gpus else "cpu", gpus, "0.0.0.0", 8000, KEY
    )


SPECS = {
    "cpu": cpu_engine_spec(Path(SETTINGS.store_path) / SNAPSHOT, 8000, "chat", api_key=KEY),
    "vllm": vllm_spec(Path(SETTINGS.store_path) / SNAPSHOT, 8000, "chat", [0, 1], api_key=KEY),
}


@pytest.mark.parametrize(("engine", "gpus", "uri"), [("cpu", 0, None), ("vllm", 2, "s3://models/chat")])
def test_the_manifests_are_valid_and_carry_the_key_only_by_reference(
    engine: str, gpus: int, uri: str | None
) -> None:
    spec = SPECS[engine]
    pod = pod_manifest(SETTINGS, placement(gpus, uri), spec, started_at=1.5)
    secret = secret_manifest(SETTINGS, placement(gpus, uri), spec)
    for manifest in (pod, secret):
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    assert KEY not in json.dumps(pod)
    [container] = pod["spec"]["containers"]
    assert container["command"] == [spec.program] and container["args"] == bind_anywhere(spec.args)
    assert "0.0.0.0" in container["args"]
    keyed = [e for e in container["env"] if "valueFrom" in e]
    assert {e["name"] for e in keyed} == set(spec.secret_env)
    assert container.get("resources", {}).get("limits") == ({"nvidia.com/gpu": "2"} if gpus else None)
    assert ("initContainers" in pod["spec"]) == (uri is not None)
    [preferred] = pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["weight"] == 100
    assert preferred["preference"]["matchExpressions"][0]["key"] == snapshot_label(SNAPSHOT)


def test_the_snapshot_label_is_a_valid_label_key_of_40_hex() -> None:
    assert snapshot_label(SNAPSHOT) == "snapshots.stoker.dev/" + SNAPSHOT[:40]


@pytest.mark.parametrize(
    ("args", "bound"),
    [
        (("--host", "127.0.0.1", "--port", "8000"), ["--host", "0.0.0.0", "--port", "8000"]),
        (("--host=::1",), ["--host=0.0.0.0"]),
        (("serve", "x"), ["serve", "x"]),
    ],
)
def test_the_engine_binds_every_address_of_its_pod(args: tuple[str, ...], bound: list[str]) -> None:
    assert bind_anywhere(args) == bound


def test_a_deployments_pod_settings_are_its_requests_placement_and_tolerations() -> None:
    from warm_pool.engine_settings import EngineSettings

    settings = EngineSettings(
        gpus=2,
        cpu="8",
        memory="64Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        tolerations=({"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},),
    )
    p = Placement("big-1a2b3c4d", "big", SNAPSHOT, None, "vllm", 2, "0.0.0.0", 8000, KEY, settings)
    pod = pod_manifest(SETTINGS, p, SPECS["vllm"], started_at=1.5)
    kubernetes_validate.validate(pod, "1.33.0", strict=True)
    [container] = pod["spec"]["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"nvidia.com/gpu": "2"},
    }
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},  # GPU nodes' usual taint
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
    ]
    plain = pod_manifest(SETTINGS, placement(0, None), SPECS["cpu"], started_at=1.5)
    assert "resources" not in plain["spec"]["containers"][0] and "tolerations" not in plain["spec"]
    assert "nodeSelector" not in plain["spec"]


def test_a_vllm_pod_loads_the_guard_from_its_image_not_from_the_controllers_path() -> None:
    """The spec's `python_path` is where this machine keeps the guard; the engine image ships it and
    sets its own PYTHONPATH (infra/docker/Dockerfile.engine), so the pod spec carries neither."""
    spec = SPECS["vllm"]
    assert spec.python_path
    [container] = pod_manifest(SETTINGS, placement(2, None), spec, started_at=1.5)["spec"]["containers"]
    assert container["args"][container["args"].index("--middleware") + 1] == "stoker_vllm_guard.EngineGuard"
    assert "PYTHONPATH" not in {e["name"] for e in container["env"]}
    assert not [a for a in container["args"] if spec.python_path[0] in a]


def test_an_engine_pod_on_tls_mounts_its_secret_read_only_and_is_probed_over_https() -> None:
    from dataclasses import replace

    from warm_pool.engine_tls import MOUNT_DIR
    from warm_pool.launch import vllm_pod_spec

    settings = replace(SETTINGS, tls_secret="stoker-engine-tls")
    files = (f"{MOUNT_DIR}/tls.crt", f"{MOUNT_DIR}/tls.key")
    spec = vllm_pod_spec(Path(SETTINGS.store_path) / SNAPSHOT, 8000, "chat", 1, api_key=KEY, ssl_files=files)
    pod = pod_manifest(settings, placement(1, None), spec, started_at=1.5)
    kubernetes_validate.validate(pod, "1.33.0", strict=True)
    [container] = pod["spec"]["containers"]
    # `stoker vllm-serve` takes the files (and hands vLLM its --ssl-* flags), before the `--`.
    args = container["args"]
    assert args[args.index("--tls-cert") + 1] == files[0] and args.index("--tls-key") < args.index("--")
    assert {"name": "engine-tls", "mountPath": MOUNT_DIR, "readOnly": True} in container["volumeMounts"]
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "engine-tls"]
    assert volume["secret"]["secretName"] == "stoker-engine-tls"
    assert [i["key"] for i in volume["secret"]["items"]] == ["tls.crt", "tls.key"]  # never the CA's key
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # Without a Secret: plain HTTP, nothing mounted.
    plain = pod_manifest(SETTINGS, placement(1, None), spec, started_at=1.5)
    assert plain["spec"]["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert [v["name"] for v in plain["spec"]["volumes"]] == ["snapshots"]
