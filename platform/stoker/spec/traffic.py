"""A deployment's traffic split as the admin API takes it (`stoker traffic`, `POST
/admin/v1/deployments/{name}/traffic`): whole percents per revision that exists, summing to 100.
"""

from __future__ import annotations

from stoker.errors import invalid


def parse_traffic(value: object, known: set[int]) -> dict[int, int]:
    """A split from the API (`{"3": 10, "2": 90}`): revisions that exist, whole percents that sum
    to 100. Revisions given 0 are left out. Raises 400 naming `traffic`."""
    if not isinstance(value, dict) or not value:
        raise invalid(
            '\'traffic\' must be an object of revision: percent, e.g. {"3": 10, "2": 90}.', "traffic"
        )
    out: dict[int, int] = {}
    for key, percent in value.items():
        try:
            revision = int(key)
        except (TypeError, ValueError):
            raise invalid(f"'traffic' keys must be revision numbers, got {key!r}.", "traffic") from None
        if revision not in known:
            raise invalid(f"'traffic' names revision {revision}, which does not exist.", "traffic")
        if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
            raise invalid(f"'traffic' percents must be whole numbers 0..100, got {percent!r}.", "traffic")
        if percent:
            out[revision] = percent
    if sum(out.values()) != 100:
        raise invalid(f"'traffic' percents must sum to 100, got {sum(out.values())}.", "traffic")
    return out
