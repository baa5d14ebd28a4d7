"""A warm runtime for vLLM: a process of vLLM's environment with vLLM imported ahead, that becomes
`vllm serve` in-process on a handoff (the warm-runtime tier, `warm_pool.handoff`).

    STOKER_RUNTIME_TOKEN=… .venv-vllm/bin/python infra/vllm-cpu/runtime.py --socket-dir DIR

What a `vllm serve` start pays before it touches the model, paid ahead: the interpreter, vLLM's
CLI, its API server, the V1 engine and the CPU worker with their imports (torch, transformers, the
model's class). It then waits on `DIR/handoff.sock` for one handoff, the same engine-agnostic
message as Stoker's own runtime takes: argv of the `vllm` command (`serve MODEL --host … --port …`),
additions to the environment, the directory to run in, the runtime's token, and the instance's log
as a file descriptor. It takes over (`warm_pool.handoff.take_over`: environment, directory, log as
stdout and stderr, PID answered, socket removed) and runs vLLM's own CLI with that argv, so the
pool's launch spec (`warm_pool.launch.vllm_spec`) is served unchanged, with the runtime's PID.
A handoff that names a successor (the pool asks it of a CPU build's runtimes) is forked first
(`warm_pool.succession.become_engine`): a copy with vLLM imported that takes the next start.

The engine core. vLLM V1 runs its engine core in a child process of the API server. vLLM's CPU
platform makes that child a *spawned* one (`VLLM_WORKER_MULTIPROC_METHOD=spawn`, set in
`CpuPlatform.check_and_update_config`), which starts a fresh interpreter and imports torch and vLLM
again: the imports a runtime paid ahead would then be paid again on every start, by the child.
Unless `STOKER_VLLM_RUNTIME_SPAWN=1`, this runtime puts `fork` back right after that check, so the
engine core is a fork of the runtime and inherits its imports. vLLM forks its engine core on GPUs
by default (while CUDA is not initialised), so this is one of vLLM's own paths. The CPU platform
gives no reason for spawn where it sets it; the usual hazard of forking a torch process is a parent
whose OpenMP thread pool already runs, and a runtime has run no torch operation when it forks (it
only imported).

Refused (one error reply, exit 2, the pool starts another): a handoff that is not `serve`, and one
whose environment sets a variable vLLM reads at import (`IMPORT_TIME_ENV`, e.g. its logging
settings) to another value than the runtime started with: that one needs a fresh process.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # warm_pool.handoff: standard library only, shared with the pool
    sys.path.insert(0, str(REPO))

from warm_pool.handoff import TOKEN_ENV, Handoff, HandoffError, die_with_keeper, listen  # noqa: E402
from warm_pool.succession import become_engine  # noqa: E402

SPAWN_ENV = "STOKER_VLLM_RUNTIME_SPAWN"
# What `vllm serve` imports before it serves, and what its engine core imports to build and run a
# CPU model (the V1 engine, the CPU worker and model runner, the attention backend, the Llama
# family's model class). Missing ones are skipped: the list is a hint, not a contract.
PRELOAD = (
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.serve.utils.api_utils",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader",
    "transformers",
)
# Variables vLLM reads when it is imported (its logger is configured at import): a runtime started
# with one value cannot serve a launch that asks for another.
IMPORT_TIME_ENV = (
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_PREFIX",
    "VLLM_PLUGINS",
)


def cli_main():
    """vLLM's CLI main, behind the same version shim as `.venv-vllm/bin/vllm` (infra/vllm-cpu/vllm):
    vllm-cpu's CLI looks up the distribution "vllm", which is installed as "vllm-cpu"."""
    return runpy.run_path(str(Path(__file__).with_name("vllm")), run_name="stoker_vllm_cli")["main"]


def preload() -> list[str]:
    """Import `PRELOAD` and resolve vLLM's platform (CPU here); the modules that could not be imported."""
    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    from vllm.platforms import current_platform

    current_platform.device_type  # noqa: B018  the platform is detected lazily: detect it now
    return missing


def fork_engine_core() -> None:
    """After vLLM's CPU platform has asked for `spawn` (it does so while checking the config, in the
    API server, before the engine core starts), ask for `fork` again: the engine core then inherits
    this process's imports instead of importing everything again."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    check = platform.check_and_update_config  # bound to the class

    def check_and_update_config(cls, vllm_config) -> None:
        check(vllm_config)
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        # The platform also sets variables that torch reads when its modules are imported; a
        # spawned core would import them with these set, a forked one has them imported already.
        threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
        inductor = sys.modules.get("torch._inductor.config")
        if threads and threads.isdigit() and inductor is not None:
            inductor.compile_threads = int(threads)  # no async compile workers in a daemonic core

    platform.check_and_update_config = classmethod(check_and_update_config)
    # Said in each forked child's output, so the log tells which processes inherited the imports.
    os.register_at_fork(after_in_child=lambda: print(f"vllm runtime: forked pid {os.getpid()}", flush=True))


def refuse(handoff: Handoff, environ: dict[str, str]) -> str | None:
    """Why this runtime will not become `handoff`, or None: it runs `vllm serve` and nothing else, and
    only with the settings vLLM read when this runtime imported it.

    >>> refuse(Handoff(("serve", "m")), {}) is None
    True
    >>> refuse(Handoff(("bench", "serve")), {})
    'a vLLM runtime runs `vllm serve`, not `vllm bench`'
    >>> refuse(Handoff(("serve", "m"), {"VLLM_LOGGING_LEVEL": "DEBUG"}), {})
    "VLLM_LOGGING_LEVEL differs from the runtime's (vLLM reads it at import)"
    """
    if handoff.argv[0] != "serve":
        return f"a vLLM runtime runs `vllm serve`, not `vllm {handoff.argv[0][:40]}`"
    for name in IMPORT_TIME_ENV:
        if name in handoff.env and handoff.env[name] != environ.get(name):
            return f"{name} differs from the runtime's (vLLM reads it at import)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket-dir", type=Path, required=True, help="private directory (0700) for the socket")
    args = ap.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, "")  # the engine it becomes does not inherit it
    if not token:
        print(f"vllm runtime: error: {TOKEN_ENV} is not set", file=sys.stderr)
        return 2
    if not die_with_keeper():
        return 0  # its keeper is gone already: no one will hand it a start
    t0 = time.monotonic()
    missing = preload()
    main_fn = cli_main()
    if os.environ.get(SPAWN_ENV) != "1":
        fork_engine_core()
    try:
        listener = listen(args.socket_dir)
    except (HandoffError, OSError) as exc:
        print(f"vllm runtime: error: cannot listen in {args.socket_dir}: {exc}", file=sys.stderr)
        return 2
    skipped = f" (not found: {', '.join(missing)})" if missing else ""
    print(f"vllm runtime pid {os.getpid()}: imports done in {time.monotonic() - t0:.2f}s{skipped}; waiting")
    sys.stdout.flush()
    try:  # forking its successor at each handoff that names one (the pool asks of a CPU build only)
        handoff = become_engine(listener, token, forks=True, refuse=lambda h: refuse(h, dict(os.environ)))
    except HandoffError as exc:
        print(f"vllm runtime: error: handoff refused: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("PYTHONUNBUFFERED"):  # read at interpreter start: honour it for the engine now
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    print(f"vllm runtime pid {os.getpid()}: becoming `vllm {handoff.argv[0]}`", flush=True)
    sys.argv = ["vllm", *handoff.argv]
    return main_fn() or 0


if __name__ == "__main__":
    sys.exit(main())
