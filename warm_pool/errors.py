"""The warm pool's errors: one hierarchy, so callers catch what they can act on.

    PoolError
    ├── InvalidTransition      an instance was asked to move along an edge the lifecycle lacks (a bug)
    ├── InvalidConfig          a setting out of range; also a ValueError, `field` names the setting
    │   └── InvalidScalingConfig   a ScalingConfig field (min_warm, max, target_concurrency, ...)
    ├── StartFailed            an engine process exited, or was not ready in time; message has its log tail
    ├── SnapshotCorrupt        the deployment's snapshot failed its start-time check: no start can succeed
    ├── NoGpuAvailable         the GPU inventory cannot give an instance the GPUs it needs
    └── EngineUnavailable      the engine a deployment asks for cannot run here (no vLLM, no GPU, ...)

Process and HTTP errors (OSError, aiohttp's) are translated into these where they enter the pool.
"""

from __future__ import annotations


class PoolError(Exception):
    """Base of every error the warm pool raises on purpose."""


class InvalidTransition(PoolError):
    def __init__(self, current: str, new: str, instance_id: str | None = None) -> None:
        who = f"instance {instance_id}: " if instance_id else ""
        super().__init__(f"{who}no transition from {current} to {new}")
        self.current, self.new = current, new


class InvalidConfig(PoolError, ValueError):
    """A setting outside its allowed range; the message quotes the value and the range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class InvalidScalingConfig(InvalidConfig):
    """A `ScalingConfig` field out of range."""


class StartFailed(PoolError):
    """An instance did not become ready: its process exited first, or the deadline passed.

    `phase` says how far it got, where the raiser knows (`warm_pool.failures` names the phases);
    None leaves it to the pool, which knows which step of the start raised. `log_lines` is the
    tail of its log, line by line, for the failure record; `log_tail` the same on one line."""

    def __init__(
        self,
        message: str,
        *,
        exit_code: int | None = None,
        log_tail: str = "",
        phase: str | None = None,
        log_lines: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.phase = phase
        self.log_lines = log_lines


class SnapshotCorrupt(PoolError):
    """The snapshot an instance would load does not match its manifest (a truncated or changed file).

    Unlike a process that crashed, retrying cannot help: the pool starts no more instances of the
    deployment until it is deployed again, and its held requests are refused with this message.
    """


class NoGpuAvailable(PoolError):
    """Fewer free GPUs than an instance needs."""


class EngineUnavailable(PoolError):
    """The engine cannot run on this machine; the message is one line that says why."""
