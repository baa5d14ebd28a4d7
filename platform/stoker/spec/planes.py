"""What the two planes send each other, and its bounds: a gateway's load report (`parse_report`,
every field checked, 400 naming it), its id, and its share of an instance's concurrency. Both
sides read this: the controller (`stoker.control.cluster`) parses reports; a gateway
(`stoker.gateway.plane`) keeps what it sends within the same bounds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from stoker.errors import invalid
from stoker.spec.deployment import NAME

UNIT = re.compile(NAME.pattern + r"@[1-9][0-9]{0,8}")  # a deployment's revision, as reports name it
MAX_REPORT_FINISHED = 10_000  # completions one report may carry (a second of a busy gateway's)
MAX_REPORT_EVENTS = 1000  # failures, and unhealthy instances, one report may carry
MAX_ID_LEN = 128


def share(concurrency: int, gateways: list[str], gateway: str) -> int:
    """This gateway's part of an instance's concurrency: an even split, the remainder to the first
    in name order; at least 1 (with more gateways than slots, an instance may take a few more)."""
    if gateway not in gateways:
        gateways = sorted([*gateways, gateway])
    n = len(gateways)
    base, extra = divmod(concurrency, n)
    return max(1, base + (1 if gateways.index(gateway) < extra else 0))


def parse_gateway_id(value: object) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value) or len(value) > MAX_ID_LEN:
        raise invalid("'gateway' must be a name of letters, digits, '-', '_' or '.'.", "gateway")
    return value


def parse_report(body: Mapping[str, Any]) -> tuple[str, dict[str, dict[str, Any]]]:
    """`{"gateway": id, "deployments": {"name@revision": report}}`, every field checked (400
    naming it): one report per revision the gateway routes to."""
    gateway = parse_gateway_id(body.get("gateway"))
    deployments = body.get("deployments")
    if not isinstance(deployments, dict):
        raise invalid("'deployments' must be an object.", "deployments")
    return gateway, {name: _parse_one(name, r) for name, r in deployments.items()}


def _count(r: Mapping[str, Any], key: str, param: str | None = None) -> int:
    v = r.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 1_000_000:
        raise invalid(f"'{param or key}' must hold integers from 0 to 1000000.", param or key)
    return v


def _ident(v: object, key: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_LEN:
        raise invalid(f"'{key}' must hold instance ids.", key)
    return v


def _seconds(v: object, key: str) -> float | None:
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise invalid(f"'{key}' must be a number of seconds >= 0 or null.", key)
    return float(v)


def _list(r: Mapping[str, Any], key: str, limit: int) -> list:
    v = r.get(key, [])
    if not isinstance(v, list) or len(v) > limit:
        raise invalid(f"'{key}' must be a list of at most {limit} items.", key)
    return v


def _parse_one(name: object, r: object) -> dict[str, Any]:
    if not isinstance(name, str) or not UNIT.fullmatch(name) or not isinstance(r, dict):
        raise invalid("'deployments' maps deployment@revision to reports.", "deployments")
    outstanding = r.get("outstanding", {})
    if not isinstance(outstanding, dict) or len(outstanding) > 10_000:
        raise invalid("'outstanding' must map instance ids to counts.", "outstanding")
    finished = []
    for item in _list(r, "finished", MAX_REPORT_FINISHED):
        if not isinstance(item, list) or len(item) != 2:
            raise invalid("'finished' holds [service_s, cold_on] pairs.", "finished")
        cold = None if item[1] is None else _ident(item[1], "finished")
        finished.append((_seconds(item[0], "finished"), cold))
    unhealthy = []
    for item in _list(r, "unhealthy", MAX_REPORT_EVENTS):
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], str):
            raise invalid("'unhealthy' holds [instance id, reason] pairs.", "unhealthy")
        unhealthy.append((_ident(item[0], "unhealthy"), item[1][:500]))
    answers = []
    for item in _list(r, "answers", MAX_REPORT_FINISHED):
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], int)
            or isinstance(item[0], bool)
            or not 100 <= item[0] <= 599
        ):
            raise invalid("'answers' holds [status, first_byte_s] pairs.", "answers")
        answers.append((item[0], _seconds(item[1], "answers")))
    usage = []
    for item in _list(r, "usage", MAX_REPORT_FINISHED):
        whole = isinstance(item, list) and len(item) in (4, 6) and item[0] is not None
        whole = whole and all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:4])
        whole = whole and 0 <= min(item[1:3]) and max(item[1:3]) <= 10_000_000 and 100 <= item[3] <= 599
        adapter = item[4:] if whole else None
        if adapter:  # an adapter's answer on this unit's instances: its name and revision
            name, revision = adapter
            whole = isinstance(name, str) and NAME.fullmatch(name) is not None
            whole = whole and isinstance(revision, int) and not isinstance(revision, bool) and revision >= 1
        if not whole:
            raise invalid(
                "'usage' holds [wall, tokens_in, tokens_out, status] answers, an adapter's with "
                "[name, revision] after them.",
                "usage",
            )
        usage.append((_seconds(item[0], "usage"), item[1], item[2], item[3], *adapter))
    loads = []
    for item in _list(r, "loads", MAX_REPORT_EVENTS):
        ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[1] is not None
        engine_name = item[0] if ok else ""
        ok = ok and (NAME.fullmatch(engine_name) or UNIT.fullmatch(engine_name)) is not None
        if not ok:
            raise invalid("'loads' holds [adapter's engine name, seconds] loads.", "loads")
        loads.append((engine_name, _seconds(item[1], "loads")))
    adapters = _list(r, "adapters", MAX_REPORT_EVENTS)
    if not all(isinstance(n, str) and NAME.fullmatch(n) for n in adapters):
        raise invalid("'adapters' holds the names of adapter deployments requests arrived for.", "adapters")
    poke = r.get("poke", False)
    if not isinstance(poke, bool):
        raise invalid("'poke' must be a boolean.", "poke")
    return {
        "in_flight": _count(r, "in_flight"),
        "queued": _count(r, "queued"),
        "arrivals": _count(r, "arrivals"),
        "since_arrival_s": _seconds(r.get("since_arrival_s"), "since_arrival_s"),
        "outstanding": {_ident(k, "outstanding"): _count(outstanding, k, "outstanding") for k in outstanding},
        "routing": [_ident(i, "routing") for i in _list(r, "routing", 10_000)],
        "finished": finished,
        "failures": [_ident(i, "failures") for i in _list(r, "failures", MAX_REPORT_EVENTS)],
        "unhealthy": unhealthy,
        "answers": answers,
        "usage": usage,  # answers' tokens for the cost meter (`stoker.gateway.metering`)
        "loads": loads,  # adapters' loads on this unit's instances, for their cost
        "adapters": list(dict.fromkeys(adapters)),  # adapter deployments requests arrived for
        "poke": poke,
    }
