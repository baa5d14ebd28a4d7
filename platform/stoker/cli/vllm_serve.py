"""`stoker vllm-serve`: how an engine pod starts vLLM. The controller runs no vLLM and does not know
which build the engine image holds, so the pod asks its own (`vllm --version`: `$STOKER_VLLM`, else
`vllm` on PATH), fills in what the deployment left to the snapshot (its dtype from the manifest, its
context length from `config.json`), builds the command exactly as a local start does for that build
(`warm_pool.launch.vllm_spec`: a GPU build on the devices the pod was given, with sleep mode; a CPU
build without, its KV cache in host memory), and runs it.

The compile cache is the node's: vLLM's `VLLM_CACHE_ROOT` is a working copy of the cache kept in
the node's store for this snapshot, this vLLM and these arguments (`snapshots.compile_cache`, keyed
as a local start keys it: `warm_pool.vllm_starts.compile_key`), and once vLLM answers `/health` its
copy is kept there for the next pod on the node, unless one was kept already. So this process stays
vLLM's parent, as a small supervisor: it passes SIGTERM and SIGINT on to vLLM, which has the pod's
stdout and stderr, and exits with vLLM's status. The instance key comes in the environment
(`VLLM_API_KEY`, from the pod's Secret), never on the command line, and with it Stoker's guard
(`--middleware`, from the image's Stoker) keys every route but `/health`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from stoker.cli.parser import port
from stoker.errors import CLIError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vllm-serve", help="start vLLM in an engine pod, as the image's vLLM build needs (the controller's)"
    )
    p.add_argument("--snapshot", type=Path, required=True, help="the snapshot's directory on this node")
    p.add_argument("--port", type=port, required=True, help="the port vLLM listens on")
    p.add_argument("--host", default="0.0.0.0", help="the address vLLM binds")
    p.add_argument("--served-model-name", required=True, help="the deployment's name")
    p.add_argument("--gpus", type=int, default=0, help="the devices the pod was given (0: none)")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (auto: the snapshot's)")
    p.add_argument("--max-model-len", type=int, help="vLLM's --max-model-len (default: the model's)")
    p.add_argument("--cpu-kv-cache", type=float, default=1.0, metavar="GIB", help="a CPU build's KV cache")
    p.add_argument(
        "--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (vLLM's --ssl-certfile)"
    )
    p.add_argument("--tls-key", metavar="FILE", help="the certificate's key (vLLM's --ssl-keyfile)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then further vLLM arguments")
    p.add_argument(
        "--dry-run", action="store_true", help="print the command and its environment, start nothing"
    )
    p.set_defaults(func=cmd_vllm_serve)


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    from snapshots import SnapshotError, SnapshotStore
    from stoker.tls import TlsSettings
    from warm_pool.errors import EngineUnavailable
    from warm_pool.launch import VLLM_KEY_ENV, vllm_spec
    from warm_pool.vllm import probe_vllm, snapshot_shape, vllm_command
    from warm_pool.vllm_starts import compile_key

    tls = TlsSettings.load(args.tls_cert, args.tls_key, None)  # a bad file: one line, before vLLM starts

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
    dtype = shape.dtype if args.dtype == "auto" else args.dtype
    max_len = args.max_model_len or (None if sets_len else shape.max_model_len)
    key = compile_key(snapshot.name, runtime.version, dtype, max_len, len(gpus), tuple(extra))
    caches, work, hit = _checkout(snapshot.parent, key, dry_run=args.dry_run)
    spec = vllm_spec(
        snapshot,
        args.port,
        args.served_model_name,
        gpus,
        host=args.host,
        dtype=dtype,
        max_model_len=max_len,
        sleep_mode=bool(gpus),
        cache_root=work,
        cpu_kv_cache_gib=args.cpu_kv_cache,
        extra_args=tuple(extra),
        vllm_command=runtime.command,
        api_key=os.environ.get(VLLM_KEY_ENV),
        ssl_files=(str(tls.cert), str(tls.key)) if tls is not None else None,
    )
    build = "CPU" if runtime.cpu_build else f"GPU, {len(gpus)} device(s)"
    cache = f"compile cache {key.digest[:12]} {'kept' if hit else 'new'}"
    print(
        f"stoker vllm-serve: vLLM {runtime.version} ({build}, {cache}): {' '.join(spec.argv)}",
        file=sys.stderr,
        flush=True,
    )
    if args.dry_run:
        shown = {k: ("[redacted]" if k in spec.secret_env else v) for k, v in sorted(spec.env.items())}
        out = {"argv": list(spec.argv), "env": shown, "cwd": str(spec.cwd), "python_path": spec.python_path}
        print(json.dumps({**out, "compile_key": key.digest}))
        return 0
    try:
        on_ready = lambda: None if hit else caches.commit(key, work)  # noqa: E731
        return _supervise(spec, args.host, args.port, on_ready, tls.cert if tls is not None else None)
    finally:
        caches.discard(work)


def _checkout(store_root: Path, key, *, dry_run: bool):
    """The node's compile caches, and this start's working copy of the one for `key` (with whether
    one was kept); a dry run makes none."""
    from snapshots.compile_cache import CompileCaches
    from snapshots.errors import StoreWriteError

    caches = CompileCaches(store_root)
    if dry_run:
        return caches, None, caches.has(key)
    try:
        work, hit = caches.checkout(key)
    except StoreWriteError as exc:
        raise CLIError(f"cannot make the compile cache's working copy: {exc}") from None
    return caches, work, hit


def _supervise(spec, host: str, port: int, on_ready, cert: Path | None = None) -> int:
    """Run vLLM with its signals passed on; `on_ready` once it answers /health (over HTTPS, verified
    by its own certificate, with `cert`). Its exit status."""
    from stoker.tls import own_server_context

    context = own_server_context(cert) if cert is not None else None
    proc = subprocess.Popen(list(spec.argv), env=spec.environ(os.environ), cwd=spec.cwd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: proc.send_signal(number))
    health = f"{'https' if cert else 'http'}://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/health"
    ready = False
    while proc.poll() is None:
        if not ready and _answers(health, context):
            ready = True
            try:
                on_ready()
            except Exception as exc:  # a cache not kept costs the next start time, nothing else
                print(f"stoker vllm-serve: compile cache not kept: {exc}", file=sys.stderr, flush=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    code = proc.returncode
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


def _answers(url: str, context=None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as r:
            return r.status == 200
    except OSError:
        return False
