"""What a pod's status says, read the same way everywhere in the Kubernetes backend: alive, ready,
which container ended and how, and why it is not ready yet."""

from __future__ import annotations

from lightkube.resources.core_v1 import Pod


def alive(pod: Pod) -> bool:
    return (
        pod.metadata.deletionTimestamp is None
        and pod.status is not None
        and pod.status.phase
        not in (
            "Failed",
            "Succeeded",
        )
    )


def condition(pod: Pod, kind: str):
    return next((c for c in (pod.status and pod.status.conditions) or [] if c.type == kind), None)


def is_ready(pod: Pod) -> bool:
    ready = condition(pod, "Ready")
    return ready is not None and ready.status == "True" and bool(pod.status.podIP)


def terminated(pod: Pod):
    """(container name, its terminated state) of the container whose end is the pod's: an init
    container that failed (a pod's init containers run in order, and one that fails ends it), else
    the first container that ended. An init container that Completed with 0 did its part and is
    never blamed: a kubelet keeps its status, so an engine that crashes after a good pull is the
    engine's failure, with its exit code and its log."""
    status = pod.status
    for cs in (status and status.initContainerStatuses) or []:
        ended = cs.state.terminated if cs.state is not None else None
        if ended is not None and ended.exitCode != 0:
            return cs.name, ended
    for cs in (status and status.containerStatuses) or []:
        if cs.state is not None and cs.state.terminated is not None:
            return cs.name, cs.state.terminated
    return None


def waiting(pod: Pod) -> tuple[str, str] | None:
    """(reason, message) of a container stuck waiting, init ones first."""
    status = pod.status
    for statuses in (status and status.initContainerStatuses, status and status.containerStatuses):
        for cs in statuses or []:
            if cs.state is not None and cs.state.waiting is not None and cs.state.waiting.reason:
                return cs.state.waiting.reason, cs.state.waiting.message or ""
    return None


def pending_reason(pod: Pod) -> str:
    """Why a pod is not ready yet, from its status: unschedulable, a waiting container, its phase."""
    scheduled = condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.status == "False":
        return f"{scheduled.reason}: {scheduled.message or ''}".rstrip(": ")
    if (stuck := waiting(pod)) is not None:
        return f"{stuck[0]}: {stuck[1]}".rstrip(": ")
    return f"phase {pod.status.phase if pod.status else 'unknown'}"


def held_up(pod: Pod) -> str | None:
    """Why a pod that is not Ready is held up, when its status says (the scheduler found no node
    that fits, an image is not pulled, a container cannot be created); None while it just starts."""
    if is_ready(pod):
        return None
    scheduled = condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.status == "False":
        return pending_reason(pod)
    if (stuck := waiting(pod)) is not None and stuck[0] not in ("PodInitializing", "ContainerCreating"):
        return f"{stuck[0]}: {stuck[1]}".rstrip(": ")
    return None
