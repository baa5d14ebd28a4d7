"""`stoker engine`: run the CPU engine for one snapshot as its own process.

The process serves HTTP at once and loads the model on a background thread; `/health` answers
200 only once the model is loaded and ready to serve (`Engine.load`). SIGTERM stops accepting
connections, lets in-flight requests finish within `--grace-period`, and exits 0.

A snapshot it cannot load exits 1 with one line on stderr (`stoker: error: ...`), no traceback.
What can be told before serving is checked first: a store snapshot's files against its manifest
(`SnapshotStore.check_for_start`: sizes, and hashes of files changed since they last hashed
sound), and every safetensors header against its file's size (a truncated file). A load that fails
later, on the background thread, ends the server and exits the same way.

`--device auto` (the default) runs it on a CUDA GPU when torch sees one, on the CPU otherwise:
the same engine, with bf16 weights by default on the GPU. `--device cuda` without a GPU exits 1
with a one-line reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from pathlib import Path

from snapshots.kept_kv import DEFAULT_BYTES as DEFAULT_KEEP_BYTES
from stoker.cli.parser import port
from stoker.http import MAX_REQUEST_BYTES

log = logging.getLogger("stoker.engine")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="run the CPU engine for one snapshot (OpenAI-compatible HTTP)")
    p.add_argument(
        "--snapshot", required=True, help="snapshot directory, or a snapshot id or name in the store"
    )
    p.add_argument("--port", type=port, required=True, help="port to serve on")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--served-model-name", help="model name clients send (default: the snapshot's name)")
    p.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (default auto: cuda when torch sees a GPU, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights' dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--max-model-len", type=_positive_int, help="context window (default: model's, at most 4096)"
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=8, help="requests generated together")
    p.add_argument("--max-waiting", type=_non_negative_int, default=64, help="requests queued beyond those")
    p.add_argument("--queue-timeout", type=_positive_float, default=60.0, help="seconds a request may queue")
    p.add_argument(
        "--kv-cache-tokens", type=_positive_int, help="KV cache size in tokens (default 2×context)"
    )
    p.add_argument(
        "--kv-keep-bytes",
        type=_size,
        default=f"{DEFAULT_KEEP_BYTES >> 20}MiB",
        metavar="SIZE",
        help="most bytes of prefix KV blocks kept in the store across sleep and stop, for this snapshot "
        "and scope (0: keep none; only for a snapshot in the store)",
    )
    p.add_argument(
        "--kv-keep-scope",
        metavar="NAME",
        help="who may reuse the KV this engine keeps: engines of the same snapshot started with the same "
        "scope (default: the served model name, which the pool sets to the deployment's)",
    )
    p.add_argument(
        "--max-adapters",
        type=_non_negative_int,
        default=4,
        help="LoRA adapters loaded at once, least recently used evicted (0: none)",
    )
    p.add_argument("--max-lora-rank", type=_positive_int, default=64, help="largest LoRA rank loaded")
    p.add_argument(
        "--task",
        choices=["generate", "embed"],
        default="generate",
        help="what it serves: text generation, or /v1/embeddings only (default generate)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=MAX_REQUEST_BYTES,
        help="largest request body taken (413 beyond; the gateway's bound, so it never refuses what the gateway forwards)",
    )
    p.add_argument(
        "--grace-period", type=_positive_float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this PEM certificate (chain)")
    p.add_argument("--tls-key", metavar="FILE", help="the certificate's PEM private key")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the log shows",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stoker.errors import CLIError

    t0 = time.monotonic()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    snapshot_dir = resolve_snapshot(args.snapshot)
    pin = pin_if_stored(snapshot_dir)  # noqa: F841  (held until the process exits)
    from stoker.engine.checks import refuse_unloadable

    try:
        refuse_unloadable(snapshot_dir)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    check_weights(snapshot_dir)
    name = args.served_model_name or snapshot_dir.name
    from stoker.tls import TlsSettings

    tls = TlsSettings.load(args.tls_cert, args.tls_key, None)  # checked before the weights load

    import torch

    from stoker.engine import weights
    from stoker.engine.app import API_KEY_ENV, build_app
    from stoker.engine.core import DEFAULT_DTYPES, Engine, EngineConfig
    from stoker.engine.metrics import EngineMetrics
    from stoker.http import make_server, run_server

    imports_s = time.monotonic() - t0
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = weights.choose_device(args.device, torch.cuda.is_available())
        config = EngineConfig(
            snapshot_dir=snapshot_dir,
            served_model_name=name,
            dtype=args.dtype or DEFAULT_DTYPES[device],
            device=device,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting,
            queue_timeout_s=args.queue_timeout,
            kv_cache_tokens=args.kv_cache_tokens,
            max_adapters=args.max_adapters,
            max_lora_rank=args.max_lora_rank,
            task=args.task,
            kv_keep=kv_keep_config(snapshot_dir, args.kv_keep_bytes, args.kv_keep_scope or name),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    engine = Engine(config, EngineMetrics(name))
    engine.phases["imports"] = imports_s
    # Why the load failed, kept here: `engine.shutdown` sets engine.state to "stopping", so after
    # the server has stopped engine.state no longer says "failed" (the cause of a failed load
    # exiting 0).
    failure: list[str] = []

    def load() -> None:
        try:
            engine.load()
        except Exception as exc:
            # One line: the traceback is for --log-level debug; the exit says why (below).
            log.debug("loading %s failed", snapshot_dir, exc_info=True)
            lines = str(exc).strip().splitlines()
            engine.state, engine.failure = "failed", lines[0] if lines else type(exc).__name__
            failure.append(engine.failure)
            server.should_exit = True
            return
        log.info(
            "ready: serving %r from %s on %s at %s://%s:%d (imports %.2fs, weights %.2fs, warm-up %.2fs)",
            name,
            snapshot_dir,
            config.device,
            "https" if tls is not None else "http",
            args.host,
            args.port,
            engine.phases["imports"],
            engine.phases["weight_load"],
            engine.phases["warm_up"],
        )

    app = build_app(
        engine,
        max_body_bytes=args.max_body_bytes,
        on_startup=lambda: threading.Thread(target=load, name="engine-load", daemon=True).start(),
        on_shutdown=engine.shutdown,
        api_key=os.environ.get(API_KEY_ENV) or None,
    )
    server = make_server(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        grace_period_s=args.grace_period,
        tls=tls,
    )
    started = run_server(server)
    if failure:
        raise CLIError(f"cannot load {snapshot_dir}: {failure[0]}")
    return 0 if started else 1


def resolve_snapshot(ref: str) -> Path:
    """A directory path as given, else an id, id prefix or name in the local snapshot store."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve()
    from snapshots.store import SnapshotStore
    from stoker.paths import snapshot_store_dir

    return SnapshotStore(snapshot_store_dir()).resolve(ref).path


def pin_if_stored(snapshot_dir: Path):
    """Pin the snapshot against eviction for this process's life, when it lies in a snapshot store
    (`<store>/<id>`): the engine maps its files, so `gc` or an eviction must not remove them."""
    import re

    from snapshots.store import SnapshotStore

    if not re.fullmatch(r"[0-9a-f]{64}", snapshot_dir.name) or not (snapshot_dir / "manifest.json").is_file():
        return None  # a model directory outside any store
    store = SnapshotStore(snapshot_dir.parent)
    pin = store.pin(snapshot_dir.name, f"engine pid {os.getpid()}")
    store.check_for_start(snapshot_dir.name)  # CorruptSnapshot: one line, exit 1
    store.touch(snapshot_dir.name)
    return pin


def kv_keep_config(snapshot_dir: Path, max_bytes: int | None, scope: str):
    """Where this engine keeps prefix KV (`stoker.engine.kv_keep`): beside its snapshot in the store
    (`snapshots.kept_kv`), so it is evicted with it. None for a directory outside a store, or 0 bytes."""
    import re

    from snapshots.kept_kv import KeptKv
    from stoker.engine.kv_keep import KeepConfig

    max_bytes = DEFAULT_KEEP_BYTES if max_bytes is None else max_bytes
    in_store = re.fullmatch(r"[0-9a-f]{64}", snapshot_dir.name) and (snapshot_dir / "manifest.json").is_file()
    if not max_bytes or not in_store:
        return None
    directory = KeptKv(snapshot_dir.parent).snapshot_dir(snapshot_dir.name)
    return KeepConfig(directory, snapshot_dir.name, scope, max_bytes)


def check_weights(snapshot_dir: Path) -> None:
    """Every safetensors header must fit its file: a truncated file is refused in one line
    (InvalidSource) before torch is imported, not by a traceback from the loading thread."""
    from snapshots.weights import read_header

    for path in sorted(snapshot_dir.rglob("*.safetensors")):
        read_header(path)


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None


def _positive_int(value: str) -> int:
    n = _int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return n


def _non_negative_int(value: str) -> int:
    n = _int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return n


def _size(value: str) -> int:
    from snapshots.sizes import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return x
