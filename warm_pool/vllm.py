"""vLLM as an engine: which vLLM this machine has, what a snapshot tells its launch, and where its
start went.

- **Which vLLM.** The command comes from `stoker up --vllm CMD`, else `$STOKER_VLLM`, else `vllm` on
  PATH. `vllm --version` says which build it is: vLLM's CPU builds carry the local version label
  `+cpu` ("0.32.0+cpu"; `make vllm` installs one as `.venv-vllm/bin/vllm`). A CPU build runs where
  there is no GPU and has no sleep mode; a GPU build needs GPUs. The version also keys the compile
  cache (`snapshots.compile_cache`).
- **What the snapshot says.** Its dtype (the manifest's; without `--dtype` vLLM serves an fp32
  snapshot as bf16 and the greedy answers change) and its context length (`config.json`). A snapshot
  vLLM cannot load (no `config.json` or no safetensors) is refused at deploy with the reason.
- **Where the start went.** vLLM logs its phases; `startup_phases(log_text)` reads them back:
  weights, torch.compile, KV cache / profiling and warm-up.
- **Its warm runtime.** `runtime_kind` describes vLLM's runtimes for the keeper
  (`warm_pool.runtimes`): infra/vllm-cpu/runtime.py run by the Python of vLLM's own environment,
  taking the pool's `vllm serve` launches (bench/vllm_runtime_bench.py measures what it saves).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from warm_pool.engine_settings import MANAGED_ARGS
from warm_pool.errors import EngineUnavailable, InvalidConfig
from warm_pool.launch import VLLM_GUARD_DIR

RUNTIME_SCRIPT = Path(__file__).resolve().parent.parent / "infra" / "vllm-cpu" / "runtime.py"

PROBE_TIMEOUT_S = 120.0  # `vllm --version` imports vLLM's CLI: seconds, more on a busy 2-core machine
_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?\S*$")
# vLLM's --dtype names for the dtypes a snapshot's manifest records (torch's names).
VLLM_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


IN_IMAGE = "in-image"  # the version of a vLLM each engine pod finds in its own image


@dataclass(frozen=True)
class VllmRuntime:
    command: tuple[str, ...]
    version: str  # as `vllm --version` printed it, e.g. "0.32.0+cpu"; `IN_IMAGE`: the pod's own

    @property
    def cpu_build(self) -> bool:
        """A CPU build: PEP 440 local label "cpu" ("0.32.0+cpu"), as vLLM and torch mark theirs."""
        return "cpu" in self.version.partition("+")[2].split(".")

    @property
    def in_image(self) -> bool:
        """The vLLM of the engine image, which each pod asks itself (`stoker vllm-serve`): the
        controller runs none and does not know its build."""
        return self.version == IN_IMAGE


IMAGE_VLLM = VllmRuntime(("vllm",), IN_IMAGE)


def vllm_command(explicit: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The command that runs vLLM's CLI: `--vllm`, else `$STOKER_VLLM`, else `vllm` on PATH; None if
    there is none. The first word must be an executable file."""
    environ = os.environ if environ is None else environ
    text = explicit or environ.get("STOKER_VLLM") or ""
    if not text.strip():
        found = shutil.which("vllm", path=environ.get("PATH"))
        return (found,) if found else None
    argv = shlex.split(text)
    exe = shutil.which(argv[0], path=environ.get("PATH")) if "/" not in argv[0] else argv[0]
    if exe is None or not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise EngineUnavailable(f"the vLLM command {argv[0]!r} is not an executable file")
    return (os.path.abspath(exe), *argv[1:])


async def probe_vllm(command: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> VllmRuntime:
    """Run `COMMAND --version`; `EngineUnavailable` with one line if it fails or prints no version."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise EngineUnavailable(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: a wrapper's children go too
        await proc.wait()
        raise EngineUnavailable(f"`{command[0]} --version` did not answer within {timeout_s:g}s") from None
    lines = [line.strip() for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
    if proc.returncode != 0 or not lines or not _VERSION.match(lines[-1]):
        last = (err or out).decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        raise EngineUnavailable(f"`{command[0]} --version` failed (exit {proc.returncode}): {last[0][:200]}")
    return VllmRuntime(tuple(command), lines[-1])


def runtime_command(runtime: VllmRuntime, script: Path = RUNTIME_SCRIPT) -> tuple[str, ...] | None:
    """How to start a vLLM warm runtime for this vLLM: `python infra/vllm-cpu/runtime.py` with the
    `python` of vLLM's own environment (beside its `vllm` command), or None where there is none (a
    `vllm` that is not a virtualenv's script, or no runtime script) and vLLM starts fresh each time.

    >>> runtime_command(VllmRuntime(("/nowhere/bin/vllm",), "0.32.0+cpu")) is None
    True
    """
    python = Path(runtime.command[0]).with_name("python")
    if len(runtime.command) != 1 or not script.is_file() or not os.access(python, os.X_OK):
        return None
    return (str(python), str(script))


def runtime_kind(runtime: VllmRuntime, count: int, script: Path = RUNTIME_SCRIPT):
    """The keeper's `RuntimeKind` for `count` vLLM runtimes: it takes launches of the program "vllm"
    whose arguments begin with `serve` (warm_pool.launch.vllm_spec's), started with the vLLM
    guard's directory on their path (a launch with a key loads the guard); a CPU build's runtimes
    fork their successors (`warm_pool.succession`). None for 0 or where `runtime_command` has none."""
    from warm_pool.runtimes import RuntimeKind  # the keeper's module: only where runtimes are kept

    command = runtime_command(runtime, script)
    if count <= 0 or command is None:
        return None
    return RuntimeKind(
        "vllm",
        command,
        count,
        program="vllm",
        first_args=("serve",),
        python_path=(str(VLLM_GUARD_DIR),),
        forks=runtime.cpu_build,  # a GPU build's engine would need the CUDA state a fork does not carry
    )


# Arguments Stoker sets itself on every vLLM it starts; `stoker up --vllm-args` may not set them.
RESERVED_ARGS = (*MANAGED_ARGS, "--dtype")


def check_settings(args: Sequence[str], cpu_kv_cache_gib: float) -> None:
    """`InvalidConfig` (a ValueError) for extra vLLM arguments or a CPU KV cache Stoker cannot take."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in RESERVED_ARGS:
            raise InvalidConfig(
                "vllm_args",
                f"--vllm-args may not set {name}: Stoker sets it (from the snapshot or the deployment)",
            )
    if not (0 < cpu_kv_cache_gib <= 1024):
        raise InvalidConfig(
            "vllm_cpu_kv_cache", f"--vllm-cpu-kv-cache must be in (0, 1024] GiB, got {cpu_kv_cache_gib:g}"
        )


@dataclass(frozen=True)
class VllmLaunch:
    """How this platform starts vLLM: the runtime found, the operator's extra arguments for every
    vLLM instance (`stoker up --vllm-args`, e.g. `--enforce-eager`), and the KV cache a CPU build
    gets (GiB of host memory)."""

    runtime: VllmRuntime
    args: tuple[str, ...] = ()
    cpu_kv_cache_gib: float = 1.0

    def __post_init__(self) -> None:
        check_settings(self.args, self.cpu_kv_cache_gib)

    def sets(self, flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in self.args)


@dataclass(frozen=True)
class SnapshotShape:
    """What vLLM's launch takes from the snapshot."""

    dtype: str  # vLLM's --dtype
    max_model_len: int | None  # the model's context length, if config.json says it


def snapshot_shape(manifest_dtype: str, config: Mapping[str, object]) -> SnapshotShape:
    dtype = VLLM_DTYPES.get(manifest_dtype, "auto")
    # Multimodal and some newer configs nest the language model's settings under text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    length = text.get("max_position_embeddings") if isinstance(text, dict) else None
    ok = isinstance(length, int) and not isinstance(length, bool) and length > 0
    return SnapshotShape(dtype, length if ok else None)


def loadable_reason(files: Sequence[str], config: Mapping[str, object] | None) -> str | None:
    """Why vLLM cannot load a snapshot with these files and config.json, or None if it can."""
    if "config.json" not in files or config is None:
        return "it has no config.json (vLLM loads Hugging Face model directories)"
    if not any(f.endswith(".safetensors") for f in files):
        return "it has no .safetensors weights (a GGUF-only model must be imported, which converts it)"
    if not isinstance(config.get("architectures"), list) or not config.get("architectures"):
        return "its config.json names no architectures"
    return None


def read_config(snapshot_dir: Path) -> dict[str, object] | None:
    try:
        doc = json.loads((snapshot_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# vLLM's log lines for the phases of its start (vLLM 0.32; a line that is missing leaves its phase
# out, and a later vLLM that words them otherwise gives fewer phases, never wrong ones):
#   "Loading weights took 1.65 seconds"
#   "init engine (profile, create kv cache, warmup model) took 60.83 s"   (torch.compile is in it)
#   "torch.compile took 41.20 s in total"                                  (GPUs, vLLM's compile mode)
# On a CPU vLLM logs no compile total; the compile runs from "Warming up model for the compilation"
# to the line that saved or loaded the compiled model, which the log's timestamps (whole seconds)
# give.
_WEIGHTS = re.compile(r"Loading weights took ([\d.]+) s")
_ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_COMPILE_TOTAL = re.compile(r"torch\.compile took ([\d.]+) s in total")
_STAMP = re.compile(r"(\d\d):(\d\d):(\d\d) \[")
_COMPILE_START = "Warming up model for the compilation"
_COMPILE_END = (
    "saved AOT compiled function",
    "Directly load AOT compilation",
    "Initial profiling/warmup run",
)


def _stamp(line: str) -> int | None:
    m = _STAMP.search(line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])


def _last_float(pattern: re.Pattern[str], text: str) -> float | None:
    matches = pattern.findall(text)
    return float(matches[-1]) if matches else None


def startup_phases(log_text: str) -> dict[str, float]:
    """`{phase: seconds}` of the last start in vLLM's log: `weights`, `engine_init` (profiling, KV
    cache, warm-up, compile included) and `compile` (part of engine_init), each when logged."""
    phases: dict[str, float] = {}
    if (weights := _last_float(_WEIGHTS, log_text)) is not None:
        phases["weights"] = weights
    if (init := _last_float(_ENGINE_INIT, log_text)) is not None:
        phases["engine_init"] = init
    compile_s = _last_float(_COMPILE_TOTAL, log_text)
    if compile_s is None:
        start = end = None
        for line in log_text.splitlines():
            if _COMPILE_START in line:
                start, end = _stamp(line), None
            elif start is not None and end is None and any(mark in line for mark in _COMPILE_END):
                end = _stamp(line)
        if start is not None and end is not None:
            compile_s = float((end - start) % 86400)  # a start that runs over midnight still counts
    if compile_s is not None:
        phases["compile"] = min(compile_s, init) if init is not None else compile_s
    return phases
