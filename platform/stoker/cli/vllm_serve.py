"""`stoker vllm-serve`: how an engine pod starts vLLM. The controller runs no vLLM and does not know
which build the engine image holds, so the pod asks its own (`vllm --version`: `$STOKER_VLLM`, else
`vllm` on PATH), fills in what the deployment left to the snapshot (its dtype from the manifest, its
context length from `config.json`), builds the command exactly as a local start does for that build
(`warm_pool.launch.vllm_spec`: a GPU build on the devices the pod was given, with sleep mode; a CPU
build without, its KV cache in host memory), and execs it: the pod's process is vLLM's, and its
signals, exit status and log are vLLM's own. The instance key comes in the environment
(`VLLM_API_KEY`, from the pod's Secret), never on the command line, and with it Stoker's guard
(`--middleware`, from the image's Stoker) keys every route but `/health`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from stoker.errors import CLIError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vllm-serve", help="start vLLM in an engine pod, as the image's vLLM build needs (the controller's)"
    )
    p.add_argument("--snapshot", type=Path, required=True, help="the snapshot's directory on this node")
    p.add_argument("--port", type=int, required=True, help="the port vLLM listens on")
    p.add_argument("--host", default="0.0.0.0", help="the address vLLM binds")
    p.add_argument("--served-model-name", required=True, help="the deployment's name")
    p.add_argument("--gpus", type=int, default=0, help="the devices the pod was given (0: none)")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (auto: the snapshot's)")
    p.add_argument("--max-model-len", type=int, help="vLLM's --max-model-len (default: the model's)")
    p.add_argument("--cpu-kv-cache", type=float, default=1.0, metavar="GIB", help="a CPU build's KV cache")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then further vLLM arguments")
    p.add_argument(
        "--dry-run", action="store_true", help="print the command and its environment, start nothing"
    )
    p.set_defaults(func=cmd_vllm_serve)


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    from snapshots import SnapshotError, SnapshotStore
    from warm_pool.errors import EngineUnavailable
    from warm_pool.launch import VLLM_KEY_ENV, vllm_spec
    from warm_pool.vllm import probe_vllm, snapshot_shape, vllm_command

    extra = [a for a in args.vllm_args if a != "--"] if args.vllm_args[:1] == ["--"] else args.vllm_args
    try:
        command = vllm_command(None)
        if command is None:
            raise EngineUnavailable("no vLLM in this image: set STOKER_VLLM, or put `vllm` on PATH")
        runtime = asyncio.run(probe_vllm(command))
    except EngineUnavailable as exc:
        raise CLIError(str(exc)) from None
    snapshot = args.snapshot
    try:
        manifest = SnapshotStore(snapshot.parent).manifest(snapshot.name)
        config = json.loads((snapshot / "config.json").read_text())
    except (SnapshotError, OSError, ValueError) as exc:
        raise CLIError(f"cannot read snapshot {snapshot}: {exc}") from None
    shape = snapshot_shape(manifest.dtype, config if isinstance(config, dict) else {})
    sets_len = any(a == "--max-model-len" or a.startswith("--max-model-len=") for a in extra)
    gpus = [] if runtime.cpu_build else list(range(args.gpus))
    spec = vllm_spec(
        snapshot,
        args.port,
        args.served_model_name,
        gpus,
        host=args.host,
        dtype=shape.dtype if args.dtype == "auto" else args.dtype,
        max_model_len=args.max_model_len or (None if sets_len else shape.max_model_len),
        sleep_mode=bool(gpus),
        cpu_kv_cache_gib=args.cpu_kv_cache,
        extra_args=tuple(extra),
        vllm_command=runtime.command,
        api_key=os.environ.get(VLLM_KEY_ENV),
    )
    env = spec.environ(os.environ)  # the guard's directory ahead on vLLM's PYTHONPATH
    build = "CPU" if runtime.cpu_build else f"GPU, {len(gpus)} device(s)"
    print(
        f"stoker vllm-serve: vLLM {runtime.version} ({build}): {' '.join(spec.argv)}",
        file=sys.stderr,
        flush=True,
    )
    if args.dry_run:
        shown = {k: ("[redacted]" if k in spec.secret_env else v) for k, v in sorted(spec.env.items())}
        print(
            json.dumps(
                {"argv": list(spec.argv), "env": shown, "cwd": str(spec.cwd), "python_path": spec.python_path}
            )
        )
        return 0
    if spec.cwd is not None:
        os.chdir(spec.cwd)
    os.execvpe(spec.argv[0], list(spec.argv), env)
    return 1  # never reached: exec replaced this process
