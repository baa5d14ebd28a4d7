"""Engine launch specs (what command starts an instance) and the GPU inventory that feeds vLLM's.

A `LaunchSpec` is plain data: the backend runs it, tests compare it. The CPU engine is
`stoker engine`; on GPUs it is `vllm serve` with sleep mode, `CUDA_VISIBLE_DEVICES` naming the GPUs
the inventory handed this instance.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from warm_pool.errors import InvalidConfig, NoGpuAvailable

# Unbuffered output: an engine that dies early has written everything it had to its log, and the
# log's tail is what `StartFailed` shows.
_UNBUFFERED = {"PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # additions to the parent's environment
    health_path: str = "/health"

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))


def default_stoker_command() -> tuple[str, ...]:
    """The `stoker` script next to this interpreter, else `python -m stoker.cli`."""
    script = Path(sys.executable).with_name("stoker")
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    return (sys.executable, "-m", "stoker.cli")


def cpu_engine_spec(
    snapshot_dir: Path,
    port: int,
    served_name: str,
    *,
    host: str = "127.0.0.1",
    threads: int | None = None,
    stoker_executable: str | None = None,
    extra_args: Sequence[str] = (),
) -> LaunchSpec:
    cmd = (stoker_executable,) if stoker_executable else default_stoker_command()
    argv = [*cmd, "engine", "--snapshot", str(snapshot_dir), "--port", str(port), "--host", host]
    argv += ["--served-model-name", served_name]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return LaunchSpec(tuple([*argv, *extra_args]), env=_UNBUFFERED)


def vllm_spec(
    snapshot_dir: Path,
    port: int,
    served_name: str,
    gpus: Sequence[int],
    *,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    vllm_executable: str = "vllm",
) -> LaunchSpec:
    if not gpus:
        raise ValueError("vllm_spec needs at least one GPU")
    argv = [vllm_executable, "serve", str(snapshot_dir), "--host", host, "--port", str(port)]
    argv += ["--served-model-name", served_name, "--enable-sleep-mode"]
    if len(gpus) > 1:
        argv += ["--tensor-parallel-size", str(len(gpus))]
    env = {
        **_UNBUFFERED,
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        # vLLM serves /sleep, /wake_up and /is_sleeping only in its dev mode; the pool needs them.
        "VLLM_SERVER_DEV_MODE": "1",
    }
    return LaunchSpec(tuple([*argv, *extra_args]), env=env)


class GpuInventory:
    """Which GPU indices this machine may use, and which instance holds each."""

    def __init__(self, gpus: Sequence[int]) -> None:
        if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
            raise InvalidConfig("gpus", f"GPU indices must be distinct and >= 0, got {list(gpus)}")
        self._gpus = tuple(gpus)
        self._owner: dict[int, str] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GpuInventory:
        """From `STOKER_GPUS`, else `CUDA_VISIBLE_DEVICES` ("0,1,3"); empty if neither is set.

        As CUDA does, a negative index ends the list ("-1" hides every GPU).
        """
        environ = os.environ if environ is None else environ
        for var in ("STOKER_GPUS", "CUDA_VISIBLE_DEVICES"):
            if var in environ:
                gpus: list[int] = []
                for part in filter(None, (p.strip() for p in environ[var].split(","))):
                    try:
                        index = int(part)
                    except ValueError:
                        raise InvalidConfig(
                            var, f"{var} must list GPU indices like 0,1,3, got {environ[var]!r}"
                        ) from None
                    if index < 0:
                        break
                    gpus.append(index)
                return cls(gpus)
        return cls([])

    @property
    def gpus(self) -> tuple[int, ...]:
        return self._gpus

    def free(self) -> list[int]:
        return [g for g in self._gpus if g not in self._owner]

    def held_by(self, owner: str) -> list[int]:
        return [g for g in self._gpus if self._owner.get(g) == owner]

    def acquire(self, n: int, owner: str) -> list[int]:
        """The `n` lowest free indices, now held by `owner`; `NoGpuAvailable` if fewer are free."""
        if n < 1:
            raise ValueError(f"acquire needs n >= 1, got {n}")
        if self.held_by(owner):
            raise ValueError(f"{owner} already holds GPUs {self.held_by(owner)}; release them first")
        free = self.free()
        if len(free) < n:
            raise NoGpuAvailable(
                f"{owner} needs {n} GPU{'s' if n > 1 else ''}, {len(free)} free of {len(self._gpus)}"
                f" (held: {self._holders() or 'none'})"
            )
        for g in free[:n]:
            self._owner[g] = owner
        return free[:n]

    def release(self, owner: str) -> list[int]:
        """Free whatever `owner` holds (nothing is fine); returns the indices freed."""
        freed = self.held_by(owner)
        for g in freed:
            del self._owner[g]
        return freed

    def _holders(self) -> str:
        by_owner: dict[str, list[int]] = {}
        for g, o in sorted(self._owner.items()):
            by_owner.setdefault(o, []).append(g)
        return ", ".join(f"{o}: {gs}" for o, gs in by_owner.items())
