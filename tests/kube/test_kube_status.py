"""What a pod's status says of a start that is held up, as a real API server reports it."""

from __future__ import annotations

import pytest
from lightkube.resources.core_v1 import Pod

from warm_pool.backends.kube_status import held_up


def pod(status: dict) -> Pod:
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


def waiting(reason: str, message: str = "") -> dict:
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
            waiting("ImagePullBackOff", 'Back-off pulling image "stoker-engine:1"'),
            "ImagePullBackOff: Back-off",
        ),
        (waiting("ContainerCreating"), None),  # starting as starts do: nothing to say
        (waiting("PodInitializing"), None),
        ({"phase": "Pending"}, None),
        (
            {"phase": "Running", "podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]},
            None,
        ),
    ],
)
def test_a_start_is_held_up_only_when_the_status_says_why(status, says):
    reason = held_up(pod(status))
    assert reason == says if says is None else reason.startswith(says)
