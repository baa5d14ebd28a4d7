"""Request priority: what a request's `priority` is, its range, and how a key's class bounds it.

vLLM's semantics: an integer, lower is served first, 0 the default. A request's priority is the
body's `priority`, else its key's default (`Limits.priority`, else 0); a key may also set a floor
(`Limits.priority_min`): a request asking for less than it (to jump ahead of the keys above it)
is refused with a 400 naming `priority`, not clamped, so a client learns at once that its number
is not honoured. A key's default must respect its own floor.

The range, -1000..1000, is small enough that a class is a small integer everywhere (the hold
queue's sort key, the CPU engine's heap, vLLM's), and large enough to leave room between classes
(an interactive key at -10, the default 0, a batch at 100).

Who honours it: the activator's hold queue (`activator.slots`: classes in order, fair between keys
within one), the CPU engine's admission queue (`stoker.engine.admission`), and vLLM's scheduler
where the deployment sets `scheduling_policy: priority` (elsewhere the activator forwards no
nonzero priority to vLLM, which would refuse it: `activator.priority`).
"""

from __future__ import annotations

from typing import Any

from stoker.errors import APIError, invalid

LOWEST = -1000  # served first
HIGHEST = 1000  # served last
DEFAULT = 0
PARAM = "priority"


def checked(value: Any, name: str = PARAM) -> int:
    """`value` as a priority, or a 400 naming `name` that quotes the value and the range."""
    if type(value) is not int or not LOWEST <= value <= HIGHEST:
        raise invalid(
            f"'{name}' must be an integer in [{LOWEST}, {HIGHEST}] (lower is served first), got {value!r}.",
            name,
        )
    return value


def of_request(asked: Any, default: int | None, floor: int | None) -> int:
    """The priority of a request whose body says `asked` (None: not said), sent with a key whose
    default is `default` and floor `floor` (None: none); a 400 naming `priority` when it is no
    priority or asks for less than the floor."""
    priority = (DEFAULT if default is None else default) if asked is None else checked(asked)
    if floor is not None and priority < floor:
        raise _below(priority, floor)
    return priority


def _below(priority: int, floor: int) -> APIError:
    return invalid(
        f"'priority' may not be below this key's floor of {floor} (lower is served first), got {priority}.",
        PARAM,
    )
