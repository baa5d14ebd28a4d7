"""The `priority` a request's body carries to its instance.

The gateway settles each request's priority (the body's, else its key's default: a small integer,
lower is served first) and hands it to the activator, which orders its hold queue by it (`slots`).
The engine may order its own queue by it too, if it takes the field:

- Stoker's CPU engine always does (its admission queue; 0 is plain arrival order);
- vLLM does when started with `--scheduling-policy priority`, and refuses a request with any
  other priority than 0 when it was not (400 "priority scheduling is not enabled").

So the body that goes upstream says exactly the request's priority to an engine that takes it
(added when the key's default set it), and none to one that does not (removed: the hold queue
still honours it). Most requests need neither, and their body goes through untouched, unparsed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

FIELD = b'"priority"'


def forwarded(body: bytes, parsed: Mapping[str, Any] | None, priority: int, engine_takes: bool) -> bytes:
    """The body to send an instance for a request of `priority`: `body` itself when it already
    says what the engine should hear (`priority` where `engine_takes`, else 0 or nothing), else
    re-encoded from `parsed` (its JSON; parsed here when None) with the field set or removed."""
    wanted = priority if engine_takes else 0
    if parsed is None:
        if wanted == 0 and FIELD not in body:
            return body
        try:
            parsed = json.loads(body)
        except ValueError:
            return body  # not JSON: the engine's to refuse
        if not isinstance(parsed, dict):
            return body
    if parsed.get("priority", 0) == wanted:  # the gateway has checked that a body's is an integer
        return body
    out = {k: v for k, v in parsed.items() if k != "priority"}
    if wanted != 0:
        out["priority"] = wanted
    return json.dumps(out, separators=(",", ":")).encode()
