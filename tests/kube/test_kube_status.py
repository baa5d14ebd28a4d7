"""How the backend reads a pod's status: which container's end is the pod's (a table)."""

from __future__ import annotations

import pytest
from lightkube.resources.core_v1 import Pod

from warm_pool.backends.kube_status import terminated


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
