"""What a batch cost: its tokens' share of what its deployments spent while it ran.

A batch runs on the instances interactive traffic uses, so it has no instance-seconds of its own.
When it starts, the runner keeps each deployment's figures from the cost meter
(`stoker.control.cost.CostMeter.report`: its instance cost, storage left out, and its tokens) as the
batch's base; at any moment after, the batch's cost on a deployment is what the deployment spent
since that base, times the batch's share of the tokens it answered since then:

    cost = Σ over its deployments d:  (usd_d − base_usd_d) × min(1, batch_tokens_d / (tokens_d − base_tokens_d))

So a batch that kept an instance awake on its own pays for all of it (a batch that scaled a
deployment up from zero pays for its start), one that ran beside interactive traffic pays in
proportion to its tokens, and the batches and the interactive requests of a deployment add up to
what it spent. Worked example: a deployment spent $0.30 since the batch began and answered 10,000
tokens, 4,000 of them the batch's: the batch cost $0.12.

Tokens are prompt + completion, as `usage` reports them; a batch's tokens on a deployment are
those of its 200 answers whose body names it. A cost meter restored from an older checkpoint
after a crash may have figures below the base: those count as nothing spent, never less.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def figures(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Each deployment's [instance cost in $ (storage left out), tokens], from the cost rows."""
    out = {}
    for row in rows:
        usd = float(row.get("cost_usd") or 0.0) - float(row.get("storage_usd") or 0.0)
        tokens = float(row.get("tokens_in") or 0) + float(row.get("tokens_out") or 0)
        out[str(row["deployment"])] = [max(0.0, usd), tokens]
    return out


def batch_cost(
    now: Mapping[str, list[float]], base: Mapping[str, list[float]], tokens: Mapping[str, int]
) -> float:
    """The batch's cost in $ (see the module): `now` and `base` as `figures` gives them, `tokens`
    the batch's own per deployment."""
    total = 0.0
    for deployment, own in tokens.items():
        if own <= 0 or deployment not in now:
            continue
        usd_now, tokens_now = now[deployment]
        usd_base, tokens_base = base.get(deployment, (0.0, 0.0))
        spent = max(0.0, usd_now - usd_base)
        answered = tokens_now - tokens_base
        total += spent * (min(1.0, own / answered) if answered > 0 else 1.0)
    return round(total, 9)
