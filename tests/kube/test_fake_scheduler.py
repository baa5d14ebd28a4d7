"""The fake's scheduler: tables for quantities, requests, tolerations and node affinity; decisions and
the scheduler's message; and, on the fake API server, a pending pod bound once room appears."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tests.kube.fake.scheduler import pod_requests, quantity, schedule, term_matches, tolerates


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", Fraction(2)),
        ("250m", Fraction(1, 4)),
        ("0.5", Fraction(1, 2)),
        ("512Mi", Fraction(512 * 1024**2)),
        ("1G", Fraction(10**9)),
        ("1e3", Fraction(1000)),
        (3, Fraction(3)),
    ],
)
def test_quantity(text: str, value: Fraction) -> None:
    assert quantity(text) == value


def test_a_malformed_quantity_is_refused() -> None:
    with pytest.raises(ValueError, match="quantities must match"):
        quantity("two")


def resources(limits: dict | None = None, requests: dict | None = None) -> dict:
    return {
        "resources": {
            **({"limits": limits} if limits else {}),
            **({"requests": requests} if requests else {}),
        }
    }


def test_a_pods_requests_sum_its_containers_a_limit_counting_as_a_request_and_an_init_at_most() -> None:
    spec = {
        "containers": [
            {"name": "a", **resources({"nvidia.com/gpu": "2"}, {"cpu": "500m"})},
            {"name": "b", **resources(requests={"cpu": "1", "memory": "1Gi"})},
        ],
        "initContainers": [{"name": "pull", **resources(requests={"cpu": "4"})}],
    }
    assert pod_requests(spec) == {"nvidia.com/gpu": 2, "cpu": 4, "memory": 1024**3, "pods": 1}


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATIONS = {
    "Exists on the key, any effect": ([{"key": "nvidia.com/gpu", "operator": "Exists"}], True),
    "Exists on the key and effect": (
        [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        True,
    ),
    "another effect": ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], False),
    "Equal with the value": ([{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}], True),
    "Equal is the default operator": ([{"key": "nvidia.com/gpu", "value": "present"}], True),
    "Equal with another value": ([{"key": "nvidia.com/gpu", "value": "absent"}], False),
    "an empty key with Exists tolerates all": ([{"operator": "Exists"}], True),
    "another key": ([{"key": "dedicated", "operator": "Exists"}], False),
    "none": ([], False),
}


@pytest.mark.parametrize(("tolerations", "tolerated"), TOLERATIONS.values(), ids=TOLERATIONS.keys())
def test_tolerates(tolerations: list[dict], tolerated: bool) -> None:
    assert tolerates(tolerations, GPU_TAINT) is tolerated


NODE = {"metadata": {"name": "gpu-1", "labels": {"zone": "a", "gpus": "8", "nvme": ""}}}
TERMS = {
    "In": ([{"key": "zone", "operator": "In", "values": ["a", "b"]}], True),
    "In, not there": ([{"key": "zone", "operator": "In", "values": ["c"]}], False),
    "NotIn": ([{"key": "zone", "operator": "NotIn", "values": ["c"]}], True),
    "NotIn of a missing label": ([{"key": "rack", "operator": "NotIn", "values": ["x"]}], True),
    "Exists": ([{"key": "nvme", "operator": "Exists"}], True),
    "DoesNotExist": ([{"key": "nvme", "operator": "DoesNotExist"}], False),
    "Gt": ([{"key": "gpus", "operator": "Gt", "values": ["4"]}], True),
    "Lt": ([{"key": "gpus", "operator": "Lt", "values": ["4"]}], False),
    "Gt of a missing label": ([{"key": "rack", "operator": "Gt", "values": ["1"]}], False),
    "expressions are ANDed": (
        [{"key": "zone", "operator": "In", "values": ["a"]}, {"key": "nvme", "operator": "DoesNotExist"}],
        False,
    ),
    "an empty term matches nothing": ([], False),
}


@pytest.mark.parametrize(("expressions", "matched"), TERMS.values(), ids=TERMS.keys())
def test_node_affinity_terms(expressions: list[dict], matched: bool) -> None:
    assert term_matches(NODE, {"matchExpressions": expressions}) is matched


def test_match_fields_on_the_node_name() -> None:
    assert term_matches(
        NODE, {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}]}
    )
    assert not term_matches(
        NODE, {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-1"]}]}
    )


def node(
    name: str, gpus: int = 0, labels: dict | None = None, taints: list | None = None, **spec: object
) -> dict:
    allocatable = {
        "cpu": "8",
        "memory": "32Gi",
        "pods": "110",
        **({"nvidia.com/gpu": str(gpus)} if gpus else {}),
    }
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {**({"taints": taints} if taints else {}), **spec},
        "status": {"allocatable": allocatable},
    }


def gpu_pod(n: int, **spec: object) -> dict:
    return {"containers": [{"name": "engine", **resources({"nvidia.com/gpu": str(n)})}], **spec}


DEDICATED = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
DECISIONS = {
    "fits on the one with room": (gpu_pod(2), [node("a", 1), node("b", 2)], {}, "b", ""),
    "what is bound there counts": (gpu_pod(2), [node("a", 2), node("b", 4)], {"b": [gpu_pod(3)]}, "a", ""),
    "too many GPUs, and a taint": (
        gpu_pod(4),
        [node("a", 2), node("b", 8, taints=[DEDICATED])],
        {},
        None,
        "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint {dedicated: gpu}.",
    ),
    "the taint tolerated": (
        gpu_pod(4, tolerations=[{"key": "dedicated", "operator": "Equal", "value": "gpu"}]),
        [node("a", 2), node("b", 8, taints=[DEDICATED])],
        {},
        "b",
        "",
    ),
    "PreferNoSchedule does not filter": (
        gpu_pod(1),
        [node("a", 1, taints=[{**DEDICATED, "effect": "PreferNoSchedule"}])],
        {},
        "a",
        "",
    ),
    "a selector, counted": (
        {**gpu_pod(1), "nodeSelector": {"pool": "gpu"}},
        [node("a", 1), node("b", 1), node("c", 1, {"pool": "gpu"}, unschedulable=True)],
        {},
        None,
        "0/3 nodes are available: 1 node(s) were unschedulable, 2 node(s) didn't match Pod's node affinity/selector.",
    ),
    "cpu and memory short, each a reason": (
        {"containers": [{"name": "c", **resources(requests={"cpu": "16", "memory": "64Gi"})}]},
        [node("a")],
        {},
        None,
        "0/1 nodes are available: 1 Insufficient cpu, 1 Insufficient memory.",
    ),
    "no nodes": (gpu_pod(1), [], {}, None, "no nodes available to schedule pods"),
    "preferred affinity wins, else the name": (
        {
            "containers": [{"name": "c"}],
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "preference": {"matchExpressions": [{"key": "snap", "operator": "Exists"}]},
                        }
                    ]
                }
            },
        },
        [node("a"), node("b", labels={"snap": "true"})],
        {},
        "b",
        "",
    ),
}


@pytest.mark.parametrize(
    ("spec", "nodes", "bound", "chosen", "message"), DECISIONS.values(), ids=DECISIONS.keys()
)
def test_schedule(spec: dict, nodes: list[dict], bound: dict, chosen: str | None, message: str) -> None:
    bound_pods = {name: [{"spec": s} for s in specs] for name, specs in bound.items()}
    decision = schedule(spec, nodes, bound_pods)
    assert (decision.node, decision.message) == (chosen, message)
