"""How the backend reads a pod's status: which container's end is the pod's, and why a start is held
up (tables)."""

from __future__ import annotations

import pytest
from lightkube.resources.core_v1 import Pod

from warm_pool.backends.kube_status import held_up, terminated


def status(name: str, state: dict) -> dict:
    return {"name": name, "image": "i", "imageID": "", "ready": False, "restartCount": 0, "state": state}


def ended(name: str, code: int) -> dict:
    return status(name, {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}})


def running(name: str) -> dict:
    return status(name, {"running": {}})


def waiting(name: str) -> dict:
    return status(name, {"waiting": {"reason": "PodInitializing"}})


CASES = {
    "the pull failed": ([ended("snapshot-pull", 1)], [waiting("engine")], ("snapshot-pull", 1)),
    "the engine crashed after a good pull": (
        [ended("snapshot-pull", 0)],
        [ended("engine", 3)],
        ("engine", 3),
    ),
    "the engine exited 0 after a good pull": (
        [ended("snapshot-pull", 0)],
        [ended("engine", 0)],
        ("engine", 0),
    ),
    "a good pull, the engine runs": ([ended("snapshot-pull", 0)], [running("engine")], None),
    "the second init container failed": ([ended("a", 0), ended("b", 2)], [waiting("engine")], ("b", 2)),
    "no init container, the engine crashed": ([], [ended("engine", 137)], ("engine", 137)),
    "nothing ended": ([running("snapshot-pull")], [waiting("engine")], None),
}


@pytest.mark.parametrize(("inits", "containers", "blamed"), CASES.values(), ids=CASES.keys())
def test_the_container_blamed_for_a_pods_end(inits: list, containers: list, blamed: tuple | None) -> None:
    pod = Pod.from_dict(
        {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "engine"}]},
            "status": {"phase": "Failed", "initContainerStatuses": inits, "containerStatuses": containers},
        }
    )
    found = terminated(pod)
    assert ((found[0], found[1].exitCode) if found is not None else None) == blamed


def pod_with(status: dict) -> Pod:
    return Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "big-1"}, "status": status})


UNSCHEDULABLE = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
        }
    ],
}


def held(reason: str, message: str = "") -> dict:
    return {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {
                "name": "engine",
                "image": "stoker-engine:1",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}},
            }
        ],
    }


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (UNSCHEDULABLE, "Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
        (
            held("ImagePullBackOff", 'Back-off pulling image "stoker-engine:1"'),
            "ImagePullBackOff: Back-off",
        ),
        (held("ContainerCreating"), None),  # starting as starts do: nothing to say
        (held("PodInitializing"), None),
        ({"phase": "Pending"}, None),
        (
            {"phase": "Running", "podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]},
            None,
        ),
    ],
)
def test_a_start_is_held_up_only_when_the_status_says_why(status, says):
    reason = held_up(pod_with(status))
    assert reason == says if says is None else reason.startswith(says)
