"""Engine launch specs (what command starts an instance) and the GPU inventory that feeds vLLM's.

A `LaunchSpec` is plain data: the backend runs it, tests compare it. The CPU engine is
`stoker engine`; vLLM is `vllm serve`: on GPUs with sleep mode and `CUDA_VISIBLE_DEVICES` naming the
GPUs the inventory handed this instance, on a CPU (vLLM's CPU build) without either, and with the
instance's key behind Stoker's guard (`warm_pool/vllm_guard/stoker_vllm_guard.py`).
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
ENGINE_KEY_ENV = "STOKER_ENGINE_API_KEY"  # stoker.engine.app.API_KEY_ENV: warm_pool imports no stoker
VLLM_KEY_ENV = "VLLM_API_KEY"  # vLLM's --api-key, from the environment
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's /v1/load_lora_adapter, served with it
# Stoker's guard inside vLLM's API server (`vllm serve --middleware`), and the directory that holds
# only it: vLLM's Python, where Stoker is not installed, imports it from there.
VLLM_GUARD = "stoker_vllm_guard.EngineGuard"
VLLM_GUARD_DIR = Path(__file__).resolve().parent / "vllm_guard"


@dataclass(frozen=True)
class LaunchSpec:
    """What starts an engine. `argv[:program_argc]` names the program as this machine runs it (a
    venv's script, `python -m stoker.cli.main`); a backend that runs it elsewhere (a pod's image) puts
    `program` there instead and keeps the arguments. `secret_env` names the variables of `env`
    that hold secrets (the engine's key): a pod gets those from a Secret, never in its spec.

    `python_path` names directories the program's Python imports from, as this machine has them
    (the vLLM guard's), put ahead on its `PYTHONPATH` (`environ`); a backend that runs the image's
    program leaves them out, as it does `argv[:program_argc]`: the image ships them itself."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # additions to the parent's environment
    health_path: str = "/health"
    cwd: Path | None = None  # None: the platform's own
    program: str = "stoker"  # "stoker" | "vllm": the executable an engine image provides
    program_argc: int = 1
    secret_env: frozenset[str] = frozenset()
    python_path: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "secret_env", frozenset(self.secret_env))
        object.__setattr__(self, "python_path", tuple(self.python_path))

    @property
    def args(self) -> tuple[str, ...]:
        """The program's arguments, without what names the program."""
        return self.argv[self.program_argc :]

    def environ(self, parent: Mapping[str, str]) -> dict[str, str]:
        """The environment the program runs with on this machine: `parent`'s, `env` added, and
        `python_path` ahead of whatever `PYTHONPATH` that gives."""
        return with_python_path({**parent, **self.env}, self.python_path)


def with_python_path(environ: Mapping[str, str], dirs: Sequence[str]) -> dict[str, str]:
    """`environ` with `dirs` ahead on its `PYTHONPATH` (a copy; `environ` itself is unchanged).

    >>> with_python_path({"PYTHONPATH": "/src"}, ["/guard"])["PYTHONPATH"]
    '/guard:/src'
    """
    out = dict(environ)
    if dirs:
        out["PYTHONPATH"] = os.pathsep.join([*dirs, *filter(None, [out.get("PYTHONPATH")])])
    return out


def default_stoker_command() -> tuple[str, ...]:
    """The `stoker` script next to this interpreter, else `python -m stoker.cli.main`."""
    script = Path(sys.executable).with_name("stoker")
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    return (sys.executable, "-m", "stoker.cli.main")


def cpu_engine_spec(
    snapshot_dir: Path,
    port: int,
    served_name: str,
    *,
    host: str = "127.0.0.1",
    threads: int | None = None,
    stoker_executable: str | None = None,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
    gpus: Sequence[int] = (),
) -> LaunchSpec:
    """`stoker engine` on a snapshot. Without `gpus` on the CPU (`--device cpu`: with `auto` it would
    take a GPU the inventory does not know it holds); with one, `--device auto` and
    `CUDA_VISIBLE_DEVICES` naming it, so the engine runs on CUDA (its pinned-staging load, its sleep
    and wake) where torch sees that device, and on the CPU where it does not."""
    if len(gpus) > 1:
        raise ValueError(f"Stoker's engine runs on one device, got {len(gpus)}")
    cmd = (stoker_executable,) if stoker_executable else default_stoker_command()
    argv = [*cmd, "engine", "--snapshot", str(snapshot_dir), "--port", str(port), "--host", host]
    argv += ["--served-model-name", served_name, "--device", "auto" if gpus else "cpu"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    # The instance's secret goes in the environment, readable by its owner only (argv is public).
    env = {**_UNBUFFERED, **({ENGINE_KEY_ENV: api_key} if api_key else {})}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    secret = frozenset({ENGINE_KEY_ENV} if api_key else ())
    return LaunchSpec(
        tuple([*argv, *extra_args]), env=env, program="stoker", program_argc=len(cmd), secret_env=secret
    )


def vllm_spec(
    snapshot_dir: Path,
    port: int,
    served_name: str,
    gpus: Sequence[int],
    *,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    max_model_len: int | None = None,
    sleep_mode: bool = True,
    cache_root: Path | None = None,
    cpu_kv_cache_gib: float = 1.0,
    extra_args: Sequence[str] = (),
    vllm_command: Sequence[str] = ("vllm",),
    api_key: str | None = None,
    ssl_files: tuple[str, str] | None = None,
) -> LaunchSpec:
    """`vllm serve` on a snapshot. With GPUs: `CUDA_VISIBLE_DEVICES`, tensor parallel over them, and
    sleep mode (served only in vLLM's dev mode). Without (vLLM's CPU build): a KV cache of
    `cpu_kv_cache_gib` in host memory, and no sleep mode, which the CPU build refuses. With
    `--enable-lora` among `extra_args` (`EngineSettings.max_adapters`), vLLM's run-time LoRA API.

    With `api_key`, Stoker's guard (`VLLM_GUARD`) wants it on every route but `/health` and refuses
    every route Stoker does not call, dev mode's among them. Sleep mode needs the key: dev mode
    without the guard would serve `/collective_rpc` to anyone who reaches the port.

    The model is named relative to the store (the process starts in the snapshot's parent dir):
    vLLM hashes the model's path into its compile cache key, and `<snapshot id>` is the same on
    every node, where `/var/lib/…/<snapshot id>` need not be. A cache built on one node then loads
    on another."""
    argv = [*vllm_command, "serve", snapshot_dir.name, "--host", host, "--port", str(port)]
    argv += ["--served-model-name", served_name, "--dtype", dtype]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if ssl_files is not None:  # HTTPS (`warm_pool.engine_tls`): the certificate, and its key
        argv += ["--ssl-certfile", ssl_files[0], "--ssl-keyfile", ssl_files[1]]
    # vLLM reports usage statistics to its project's server unless told not to: a platform that
    # serves its users' models does not send out what they run.
    env = {**_UNBUFFERED, "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if len(gpus) > 1:
            argv += ["--tensor-parallel-size", str(len(gpus))]
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{cpu_kv_cache_gib:g}"
        # The one worker in the engine-core process (vLLM's uniprocess executor): by default it is
        # a process of its own that imports torch and vLLM again. Two processes instead of three:
        # a start with the compile cache took 17-18 s to healthy against 23-26 s (SmolLM2, this
        # 2-core machine). vLLM's CPU platform turns `uni` back into `mp` unless
        # VLLM_ENABLE_V1_MULTIPROCESSING is 0 (its reason: OpenMP's settings are applied per worker
        # process); the API server's engine core stays a process of its own either way, and the
        # decode figures of bench/engines_bench.py were measured with this launch.
        # (`--vllm-args` come later and win.)
        argv += ["--distributed-executor-backend", "uni"]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if sleep_mode:
        if not gpus:
            raise ValueError("vLLM's sleep mode needs a GPU")
        if not api_key:
            raise ValueError("vLLM's sleep mode needs an api_key: its dev mode is guarded by it")
        argv.append("--enable-sleep-mode")
        # vLLM serves /sleep, /wake_up and /server_info only in its dev mode; the pool needs them.
        env["VLLM_SERVER_DEV_MODE"] = "1"
    python_path: tuple[str, ...] = ()
    if api_key:
        # vLLM's --api-key, from the environment: argv is visible to every local user. vLLM guards
        # only its /v1 routes with it; the guard reads the same variable and guards every route.
        env["VLLM_API_KEY"] = api_key
        argv += ["--middleware", VLLM_GUARD]
        python_path = (str(VLLM_GUARD_DIR),)
    if "--enable-lora" in extra_args:
        # A deployment that hosts adapters (`max_adapters`): the activator loads each one on the
        # instance at its first request (POST /v1/load_lora_adapter), a route vLLM serves only with
        # this set. Its tenants cannot reach it: the gateways proxy chat, completions and models only.
        env[RUNTIME_LORA_ENV] = "True"
    if cache_root is not None:
        # Where vLLM keeps its torch.compile artifacts: a directory of the snapshot store, keyed by
        # snapshot, vLLM version and the arguments that change compilation (snapshots.compile_cache).
        env["VLLM_CACHE_ROOT"] = str(cache_root)
        # Inductor's own cache too (by default /tmp/torchinductor_<user>, shared and not kept).
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root / "inductor")
    return LaunchSpec(
        tuple([*argv, *extra_args]),
        env=env,
        cwd=snapshot_dir.parent,
        program="vllm",
        program_argc=len(vllm_command),
        secret_env=frozenset({"VLLM_API_KEY"} if api_key else ()),
        python_path=python_path,
    )


def vllm_pod_spec(
    snapshot_dir: Path,
    port: int,
    served_name: str,
    gpus: int,
    *,
    host: str = "0.0.0.0",
    dtype: str = "auto",
    max_model_len: int | None = None,
    cpu_kv_cache_gib: float = 1.0,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
    ssl_files: tuple[str, str] | None = None,
) -> LaunchSpec:
    """vLLM in an engine pod, decided in the pod: `stoker vllm-serve` asks the image's own vLLM which
    build it is (`vllm --version`) and starts it as `vllm_spec` starts that build here (a GPU
    build on the `gpus` devices the pod was given, with sleep mode; a CPU build without), by exec,
    so that the pod's process is vLLM's. The controller runs no vLLM and need not know the image's."""
    argv = ["stoker", "vllm-serve", "--snapshot", str(snapshot_dir), "--port", str(port), "--host", host]
    argv += ["--served-model-name", served_name, "--gpus", str(gpus), "--dtype", dtype]
    argv += ["--cpu-kv-cache", f"{cpu_kv_cache_gib:g}"]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if ssl_files is not None:
        argv += ["--tls-cert", ssl_files[0], "--tls-key", ssl_files[1]]
    argv += ["--", *extra_args]
    env = {**_UNBUFFERED, **({VLLM_KEY_ENV: api_key} if api_key else {})}
    return LaunchSpec(
        tuple(argv),
        env=env,
        program="stoker",
        program_argc=1,
        secret_env=frozenset({VLLM_KEY_ENV} if api_key else ()),
    )


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
