"""`stoker runtime`: a CPU-engine process started ahead of need, the warm-runtime tier's process.

The pool (`warm_pool.runtimes`) starts it with a token in its environment; it does what every
engine start pays first (imports torch, transformers and the engine, on a GPU the CUDA context),
then waits on a unix socket for one handoff (`warm_pool.handoff`): the `stoker engine` arguments of
an instance. It then becomes that engine in this process (same PID): the engine binds its port, maps
the snapshot and serves, with the imports already paid, so a start costs the weights and the
warm-up. A handoff that is not an `engine` command, or anything wrong with the message, ends the
runtime (exit 2) after one error reply; the pool starts another.

    STOKER_RUNTIME_TOKEN=… stoker runtime --socket-dir /run/stoker/runtimes/cpu-1a2b

At each handoff that names a successor it first forks the runtime that takes the next start
(`warm_pool.succession`): a burst of starts across deployments each finds a runtime, at a fork's
cost instead of the imports'.

Another engine kind plugs in with its own entry doing the same three steps: preload, `serve_one`,
`take_over`, then its own command line's main (forking a successor where it can).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from stoker.cli import parser as cli_parser

# What `stoker engine` imports before it serves (`stoker.cli.engine.run`) and what loading a model imports
# after (the model's classes, generation, masks): measured as the modules new in sys.modules after
# a load of a Llama snapshot. Missing ones are skipped: the list is a hint, not a contract.
PRELOAD = (
    "torch",
    "transformers",
    "stoker.engine.weights",
    "stoker.engine.core",
    "stoker.engine.app",
    "stoker.engine.metrics",
    "stoker.http",
    "uvicorn",
    "transformers.generation.utils",
    "transformers.masking_utils",
    "transformers.modeling_layers",
    "transformers.models.llama.modeling_llama",
    "transformers.tokenization_utils_fast",
    "transformers.tokenization_python",
    "transformers.processing_utils",
    "transformers.generation.candidate_generator",
    "transformers.generation.stopping_criteria",
    # What uvicorn imports when its server starts (the engine's port is bound after these).
    "uvicorn.config",
    "uvicorn.server",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "runtime", help="an engine process with its imports done, waiting for a start (the pool runs it)"
    )
    p.add_argument(
        "--socket-dir", type=Path, required=True, help="private directory (0700) for the handoff socket"
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: create the CUDA context while waiting, as an engine on the GPU would",
    )
    p.set_defaults(func=run)


def preload(device: str = "cpu") -> list[str]:
    """Import `PRELOAD` (and on `cuda` initialise CUDA); the modules that could not be imported."""
    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()
            torch.zeros(1, device="cuda")  # the context itself, not only the driver
    return missing


def refuse(argv: tuple[str, ...]) -> str | None:
    """Why a runtime will not become `argv`: it becomes an engine, nothing else."""
    if argv[0] != "engine":
        return f"a runtime runs `stoker engine`, not `stoker {argv[0][:40]}`"
    return None


def run(args: argparse.Namespace) -> int:
    from stoker.errors import CLIError
    from warm_pool.handoff import TOKEN_ENV, HandoffError, die_with_keeper, listen

    token = os.environ.pop(TOKEN_ENV, "")  # the engine it becomes does not inherit it
    if not token:
        raise CLIError(f"{TOKEN_ENV} is not set: the pool starts runtimes with their token")
    if not die_with_keeper():
        return 0  # its keeper is gone already: no one will hand it a start
    t0 = time.monotonic()
    missing = preload(args.device)
    try:
        listener = listen(args.socket_dir)
    except (HandoffError, OSError) as exc:
        raise CLIError(f"cannot listen in {args.socket_dir}: {exc}") from None
    skipped = f" (not found: {', '.join(missing)})" if missing else ""
    print(
        f"runtime pid {os.getpid()}: imports done in {time.monotonic() - t0:.2f}s{skipped}; waiting",
        flush=True,
    )
    return serve(listener, token, forks=args.device == "cpu")


def serve(listener, token: str, *, forks: bool) -> int:
    """Become the engine of the handoff that comes (`warm_pool.succession.become_engine`: forking a
    successor at each one that names it, where `forks`: no CUDA context, which a fork does not
    carry); the engine's command line's exit status, or 2 for a handoff refused."""
    from warm_pool.handoff import HandoffError
    from warm_pool.succession import become_engine

    try:
        handoff = become_engine(listener, token, forks=forks, refuse=lambda h: refuse(h.argv))
    except HandoffError as exc:
        print(f"stoker: error: handoff refused: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"runtime pid {os.getpid()}: becoming `stoker {handoff.argv[0]}`", flush=True)
    return cli_parser.run(engine_parser(), list(handoff.argv))


def engine_parser() -> argparse.ArgumentParser:
    """`stoker engine`'s parser alone: all a runtime may become (`refuse`)."""
    from stoker.cli import engine

    parser = cli_parser.StokerParser(prog="stoker")
    engine.register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser
