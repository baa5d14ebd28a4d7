"""Pod Security as the fake admits pods: each check in the plugin's words (a table), the order of
several, the levels a namespace's labels name; and what that means for Stoker's own pods: engine
pods and the node agent need `privileged` for their hostPath store and nothing else, the
controller and the gateways pass `restricted`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.infra.test_chart import EVERYTHING, render, workloads
from tests.kube.fake.podsecurity import policy, refusal, violations
from warm_pool.backends.base import Placement
from warm_pool.backends.kube_pod import PodSettings, pod_manifest
from warm_pool.launch import cpu_engine_spec

# A pod that passes restricted, and what each change of it breaks.
GOOD_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def spec(**changes: object) -> dict:
    container = {"name": "c", "image": "i", "securityContext": dict(GOOD_CONTEXT)}
    base: dict = {"containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}]}
    for key, value in changes.items():
        if key.startswith("c_"):
            container["securityContext"][key[2:]] = value
        elif key == "ports":
            container["ports"] = value
        else:
            base[key] = value
    return base


BASELINE = {
    "hostPath": (
        spec(volumes=[{"name": "store", "hostPath": {"path": "/x"}}]),
        [("hostPath volumes", 'volume "store"')],
    ),
    "two hostPaths": (
        spec(volumes=[{"name": "a", "hostPath": {"path": "/a"}}, {"name": "b", "hostPath": {"path": "/b"}}]),
        [("hostPath volumes", 'volumes "a", "b"')],
    ),
    "privileged": (
        spec(c_privileged=True),
        [("privileged", 'container "c" must not set securityContext.privileged=true')],
    ),
    "host namespaces": (
        spec(hostNetwork=True, hostIPC=True),
        [("host namespaces", "hostNetwork=true, hostIPC=true")],
    ),
    "hostPort": (
        spec(ports=[{"containerPort": 80, "hostPort": 8080}]),
        [("hostPort", 'container "c" uses hostPort 8080')],
    ),
    "a capability beyond the default set": (
        spec(c_capabilities={"add": ["NET_ADMIN", "CHOWN"], "drop": ["ALL"]}),
        [
            (
                "non-default capabilities",
                'container "c" must not include "NET_ADMIN" in securityContext.capabilities.add',
            )
        ],
    ),
    "seccomp Unconfined": (
        spec(c_seccompProfile={"type": "Unconfined"}),
        [
            (
                "seccompProfile",
                'container "c" must not set securityContext.seccompProfile.type to "Unconfined"',
            )
        ],
    ),
    "nothing baseline forbids": (spec(c_runAsNonRoot=False, c_allowPrivilegeEscalation=True), []),
}
RESTRICTED = {
    "a hostPath is also a restricted type": (
        spec(volumes=[{"name": "store", "hostPath": {"path": "/x"}}]),
        [
            ("hostPath volumes", 'volume "store"'),
            ("restricted volume types", 'volume "store" uses restricted volume type "hostPath"'),
        ],
    ),
    "privilege escalation": (
        spec(c_allowPrivilegeEscalation=True),
        [
            (
                "allowPrivilegeEscalation != false",
                'container "c" must set securityContext.allowPrivilegeEscalation=false',
            )
        ],
    ),
    "capabilities not dropped": (
        spec(c_capabilities={"add": ["CHOWN"]}),
        [
            (
                "unrestricted capabilities",
                'container "c" must set securityContext.capabilities.drop=["ALL"]; '
                'container "c" must not include "CHOWN" in securityContext.capabilities.add',
            )
        ],
    ),
    "NET_BIND_SERVICE may be added": (
        spec(c_capabilities={"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}),
        [],
    ),
    "root allowed": (
        spec(c_runAsNonRoot=None),
        [("runAsNonRoot != true", 'pod or container "c" must set securityContext.runAsNonRoot=true')],
    ),
    "root asked for": (
        spec(c_runAsNonRoot=False, c_runAsUser=0),
        [
            ("runAsNonRoot != true", 'container "c" must not set securityContext.runAsNonRoot=false'),
            ("runAsUser=0", 'container "c" must not set runAsUser=0'),
        ],
    ),
    "non-root set for the pod": (spec(c_runAsNonRoot=None, securityContext={"runAsNonRoot": True}), []),
    "no seccomp profile": (
        spec(c_seccompProfile=None),
        [
            (
                "seccompProfile",
                'pod or container "c" must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"',
            )
        ],
    ),
}


def cleaned(s: dict) -> dict:
    """The spec with the None the table writes for "unset" left out."""
    for c in s["containers"]:
        c["securityContext"] = {k: v for k, v in c["securityContext"].items() if v is not None}
    return s


@pytest.mark.parametrize(("pod", "found"), BASELINE.values(), ids=BASELINE.keys())
def test_baseline(pod: dict, found: list) -> None:
    assert violations(cleaned(pod), "baseline") == found
    assert violations(pod, "privileged") == []


@pytest.mark.parametrize(("pod", "found"), RESTRICTED.values(), ids=RESTRICTED.keys())
def test_restricted(pod: dict, found: list) -> None:
    assert violations(cleaned(pod), "restricted") == found


def test_several_violations_in_one_message_in_the_order_of_the_checks() -> None:
    pod = spec(hostPID=True, volumes=[{"name": "store", "hostPath": {"path": "/x"}}], c_privileged=True)
    assert refusal(pod, "baseline", "latest") == (
        'violates PodSecurity "baseline:latest": host namespaces (hostPID=true), hostPath volumes (volume "store"), '
        'privileged (container "c" must not set securityContext.privileged=true)'
    )
    assert refusal(spec(), "restricted", "v1.33") is None


@pytest.mark.parametrize(
    ("labels", "level"),
    [
        ({}, ("privileged", "latest")),
        ({"pod-security.kubernetes.io/enforce": "baseline"}, ("baseline", "latest")),
        (
            {
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "v1.30",
            },
            ("restricted", "v1.30"),
        ),
        ({"pod-security.kubernetes.io/enforce": "nonsense"}, ("restricted", "latest")),
        ({"pod-security.kubernetes.io/warn": "restricted"}, ("privileged", "latest")),  # warn is not enforce
    ],
)
def test_the_namespace_labels_name_the_level(labels: dict, level: tuple[str, str]) -> None:
    assert policy(labels) == level


def engine_pod(uri: str | None) -> dict:
    settings = PodSettings(image="e:1", store_path="/mnt/nvme/stoker", owner="o")
    place = Placement("chat-1a2b3c4d", "chat", "ab" * 32, uri, "cpu", 0, "0.0.0.0", 8000, "k")
    return pod_manifest(
        settings, place, cpu_engine_spec(Path("/mnt/nvme/stoker") / ("ab" * 32), 8000, "chat"), 1.0
    )


@pytest.mark.parametrize("uri", [None, "s3://models/chat"])
def test_an_engine_pod_needs_privileged_for_its_hostpath_store_and_nothing_else(uri: str | None) -> None:
    pod = engine_pod(uri)["spec"]
    assert violations(pod, "baseline") == [("hostPath volumes", 'volume "snapshots"')]
    assert [reason for reason, _ in violations(pod, "restricted")] == [
        "hostPath volumes",
        "restricted volume types",
    ]


def test_of_the_charts_workloads_only_the_node_agent_needs_privileged_and_for_its_store_only() -> None:
    for workload in workloads(render(EVERYTHING)):
        pod = workload["spec"]["template"]["spec"]
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "node":
            assert violations(pod, "baseline") == [("hostPath volumes", 'volume "store"')]
        else:
            assert violations(pod, "restricted") == [], component
