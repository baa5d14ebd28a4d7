"""The rows of `stoker cost` (`GET /admin/v1/cost`), from the sums of `stoker.control.cost`'s
ledgers: a deployment's row and its revisions' (`summarize`), and each LoRA adapter's share of its
base's cost moved onto the adapter's row (`share_adapters`). Pure functions of the sums."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def share_adapters(
    rows: list[dict[str, Any]], bases: Mapping[str, str], load_price: Callable[[str], float]
) -> list[dict[str, Any]]:
    """Each adapter's share of its base's cost, moved from the base's row to the adapter's: the
    price of its loads (`load_s` × `load_price(base)`, a READY second of the base's instance) and
    its tokens' share of what is left of the base's instance cost (storage stays the base's). The
    rows' `cost_usd` then add up to what was spent. The base's revisions' rows keep the devices'
    whole cost.

    Worked example: base b $1.00 (of which $0.10 storage), 600 tokens of its own; adapter a1 300
    tokens and 2 s of loads at $0.01/s, a2 100 tokens. Shareable 1.00 − 0.10 − 0.02 = $0.88 over
    1,000 tokens: a1 0.88 × 0.3 + 0.02 = $0.284, a2 $0.088, b 1.00 − 0.372 = $0.628."""
    by_name = {row["deployment"]: row for row in rows}
    on: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        base = bases.get(row["deployment"])
        if base is not None and base in by_name:
            on.setdefault(base, []).append(row)
            row["base"] = base
    for base, adapters in on.items():
        b = by_name[base]
        shareable = max(0.0, b["cost_usd"] - b["storage_usd"])
        loads = [a["load_seconds"] * load_price(base) for a in adapters]
        scale = min(1.0, shareable / sum(loads)) if sum(loads) > 0 else 0.0
        loads = [usd * scale for usd in loads]
        pool = shareable - sum(loads)
        tokens = [a["tokens_in"] + a["tokens_out"] for a in adapters]
        total = b["tokens_in"] + b["tokens_out"] + sum(tokens)
        moved = 0.0
        for a, load_usd, t in zip(adapters, loads, tokens, strict=True):
            share = pool * t / total if total else 0.0
            a["base_share_usd"] = round(share, 9)
            a["load_usd"] = round(load_usd, 9)
            a["cost_usd"] = round(a["cost_usd"] + share + load_usd, 9)
            a["cost_per_1k_tokens"] = _per_1k(a["cost_usd"], t)
            a["cost_per_1k_requests"] = _per_1k(a["cost_usd"], a["requests"])
            moved += share + load_usd
        b["adapters_usd"] = round(moved, 9)
        b["cost_usd"] = round(b["cost_usd"] - moved, 9)
        b["cost_per_1k_tokens"] = _per_1k(b["cost_usd"], b["tokens_in"] + b["tokens_out"])
        b["cost_per_1k_requests"] = _per_1k(b["cost_usd"], b["requests"])
    return rows


def _per_1k(cost: float, count: float) -> float | None:
    return round(cost / count * 1000, 6) if count else None


def summarize(
    name: str, revisions: Mapping[int, Mapping[str, float]], deployment: Mapping[str, float]
) -> dict:
    """A deployment's row from its revisions' sums (`s:<STATE>`, `usd:<STATE>`, `usd:storage`,
    `requests`, `tokens_in`, `tokens_out`) and its own (`busy_s`). Worked example: READY 100 s and
    SLEEPING 50 s at $3.60 and $0.36 an hour, 3 requests of 10 + 20 tokens each, busy 6 s: cost
    0.1 + 0.005 = $0.105, per 1k tokens 0.105 / 90 × 1000 = $1.1667, per 1k requests $35, idle
    (100 + 50 − 6) / 150 = 0.96."""
    rows = [_row(sums) | {"revision": r} for r, sums in revisions.items()]
    seconds: dict[str, float] = {}
    for sums in revisions.values():
        for key, value in sums.items():
            if key.startswith("s:"):
                seconds[key[2:]] = seconds.get(key[2:], 0.0) + value
    total_s = sum(seconds.values())
    idle = max(0.0, seconds.get("READY", 0.0) + seconds.get("SLEEPING", 0.0) - deployment.get("busy_s", 0.0))
    out = {"deployment": name}
    for key in ("cost_usd", "storage_usd", "requests", "tokens_in", "tokens_out"):
        out[key] = sum(row[key] for row in rows)
    out["cost_usd"] = round(out["cost_usd"], 9)
    out["storage_usd"] = round(out["storage_usd"], 9)
    out["cost_per_1k_tokens"] = _per_1k(out["cost_usd"], out["tokens_in"] + out["tokens_out"])
    out["cost_per_1k_requests"] = _per_1k(out["cost_usd"], out["requests"])
    out["instance_seconds"] = {s: round(v, 6) for s, v in sorted(seconds.items())}
    out["idle_seconds"] = round(idle, 6)
    out["idle_share"] = round(min(1.0, idle / total_s), 6) if total_s else None
    out["load_seconds"] = round(sum(sums.get("load_s", 0.0) for sums in revisions.values()), 6)
    out["revisions"] = rows
    return out


def _row(sums: Mapping[str, float]) -> dict[str, Any]:
    cost = sum(v for k, v in sums.items() if k.startswith("usd:"))
    tokens_in, tokens_out = int(sums.get("tokens_in", 0)), int(sums.get("tokens_out", 0))
    requests = int(sums.get("requests", 0))
    return {
        "cost_usd": round(cost, 9),
        "storage_usd": round(sums.get("usd:storage", 0.0), 9),
        "requests": requests,
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "cost_per_1k_tokens": _per_1k(cost, tokens_in + tokens_out),
        "cost_per_1k_requests": _per_1k(cost, requests),
        "instance_seconds": {k[2:]: round(v, 6) for k, v in sorted(sums.items()) if k.startswith("s:")},
    }
