"""How `stoker deploy` writes a deployment's engine settings on the command line (flags named as vLLM
names them, their help from `stoker.spec.engine.SETTINGS`; a pod's selector and tolerations in
kubectl's spelling), and how `stoker describe` shows them back. The platform validates them: a bad
one is its 400, in one line."""

from __future__ import annotations

import argparse

from stoker.errors import CLIError
from stoker.spec.engine import DTYPES, SETTINGS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine settings (`stoker.spec.engine.SETTINGS`), flags named as vLLM names them; their help
    is the table's. Left out: the engine's default."""
    h = {name: s.help for name, s in SETTINGS.items()}
    g = p.add_argument_group("engine settings (vLLM's names; default: the engine's)")
    g.add_argument("--gpus", type=int, metavar="N", help=h["gpus"])
    g.add_argument("--dtype", choices=DTYPES, help=h["dtype"])
    g.add_argument("--quantization", metavar="METHOD", help=h["quantization"])
    g.add_argument("--max-model-len", type=int, metavar="TOKENS", help=h["max_model_len"])
    g.add_argument("--gpu-memory-utilization", type=float, metavar="SHARE", help=h["gpu_memory_utilization"])
    g.add_argument("--max-num-seqs", type=int, metavar="N", help=h["max_num_seqs"])
    g.add_argument("--task", choices=["generate", "embed"], help=h["task"])
    g.add_argument("--max-adapters", type=int, metavar="N", help=h["max_adapters"])
    g.add_argument("--max-adapter-rank", type=int, metavar="RANK", help=h["max_adapter_rank"])
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, help=h["enable_prefix_caching"]
    )
    g.add_argument("--enforce-eager", action="store_true", default=None, help=h["enforce_eager"])
    g.add_argument("--tool-call-parser", metavar="NAME", help=h["tool_call_parser"])
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], help=h["scheduling_policy"])
    g.add_argument(
        "--engine-arg",
        dest="engine_args",
        action="append",
        metavar="ARG",
        help=h["engine_args"] + "; one argument each, written --engine-arg=--flag=value (repeatable)",
    )
    pods = p.add_argument_group("pods (the Kubernetes backend)")
    pods.add_argument("--cpu", metavar="QUANTITY", help=h["cpu"])
    pods.add_argument("--memory", metavar="QUANTITY", help=h["memory"])
    pods.add_argument(
        "--node-selector", action="append", metavar="KEY=VALUE", help=h["node_selector"] + " (repeatable)"
    )
    pods.add_argument(
        "--toleration",
        dest="tolerations",
        action="append",
        metavar="KEY[=VALUE][:EFFECT]",
        help=h["tolerations"]
        + "; as kubectl writes taints: no value is Exists, no effect is every effect (repeatable)",
    )


def engine_body(args: argparse.Namespace) -> dict:
    """The engine settings given on the command line, as the deploy body holds them (the platform
    validates them: a bad one is its 400, in one line)."""
    body = {
        name: getattr(args, name)
        for name in SETTINGS
        if name not in ("node_selector", "tolerations") and getattr(args, name, None) is not None
    }
    if args.node_selector:
        body["node_selector"] = dict(_pair(item, "--node-selector") for item in args.node_selector)
    if args.tolerations:
        body["tolerations"] = [_toleration(item) for item in args.tolerations]
    return body


def _pair(item: str, flag: str) -> tuple[str, str]:
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise CLIError(f"{flag} takes KEY=VALUE, got {item!r}")
    return key, value


def _toleration(item: str) -> dict:
    """`key=value:NoSchedule`, `key:NoExecute`, `key` (kubectl's taint syntax) as a toleration."""
    rest, colon, effect = item.rpartition(":") if ":" in item else (item, "", "")
    key, eq, value = rest.partition("=")
    if not key or (colon and not effect):
        raise CLIError(f"--toleration takes KEY[=VALUE][:EFFECT], got {item!r}")
    out = {"key": key, "operator": "Equal" if eq else "Exists"}
    if eq:
        out["value"] = value
    if effect:
        out["effect"] = effect
    return out


def engine_line(d: dict) -> str:
    """The engine settings a deployment sets, as `stoker deploy` writes them; the rest are defaults."""
    from stoker.spec.engine import default as engine_default

    shown = []
    for name in SETTINGS:
        value = d.get(name)
        if value is None or value == engine_default(name):
            continue
        if isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list) and name == "tolerations":
            value = ",".join(
                t.get("key", "")
                + (f"={t['value']}" if "value" in t else "")
                + (f":{t['effect']}" if "effect" in t else "")
                for t in value
            )
        elif isinstance(value, list):
            value = " ".join(value)
        shown.append(f"{name} {value}")
    return "; ".join(shown) or "the engine's defaults"
