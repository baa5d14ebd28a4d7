"""Cascade routes' rules, pure: the route and its validation, the request that asks the small
deployment for logprobs and the answer that has them taken out again, an answer's score, the
signals that a prompt does not fit the small one's context, and the latency saved. No I/O but
`context_of` (one config.json); serving is `stoker.gateway.cascade`, where routes are kept
`stoker.control.routes`.

What a small answer leads to (`stoker.gateway.cascade` applies it):

    small answers 200, its choices' mean token logprob ≥ min_mean_logprob ─▶ that answer  (small)
    ... under min_mean_logprob                                            ─▶ large (escalated-unsure)
    small answers 400 "context length exceeded" (both engines' wording),
      or the prompt is clearly longer than its context (below)            ─▶ large (escalated-context)
    small fails before answering (an activator error, or a 5xx)           ─▶ large (escalated-error)
    anything else (another 4xx, an answer with no logprobs or too big)    ─▶ the small one's answer

"Clearly too long" is a cheap estimate, no tokenizer: the prompt's UTF-8 bytes / 8 (typical text
is about 4 bytes a token, so this undercounts by half), plus `max_tokens` when given, above the
small snapshot's `max_position_embeddings` (at most 4096 on the CPU engine, which caps it so). An estimate
that is short only costs one refused call to the small one, whose 400 escalates the request then.

The saving: for an answer the small one gave in t seconds, L − t where L is the mean of the
route's recent large answers; e.g. large answers of 2.0, 3.0 and 4.0 s and a small one in 0.5 s
saved 2.5 s.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stoker.errors import APIError, invalid
from stoker.spec.deployment import NAME

LOGPROB_FLOOR = -9999.0  # what both engines write for -inf
BYTES_PER_TOKEN = 8  # the context estimate's, a generous undercount (typical text: about 4)
DEFAULT_MIN_MEAN_LOGPROB = -1.0  # a geometric-mean token probability of e^-1 ≈ 0.37

SMALL = "small"
ESCALATED_UNSURE = "escalated_unsure"
ESCALATED_CONTEXT = "escalated_context"
ESCALATED_ERROR = "escalated_error"
OUTCOMES = (SMALL, ESCALATED_UNSURE, ESCALATED_CONTEXT, ESCALATED_ERROR)


# ---- the route, validated -----------------------------------------------------------------------


@dataclass(frozen=True)
class CascadeRoute:
    name: str
    small: str  # a deployment's name
    large: str
    min_mean_logprob: float = DEFAULT_MIN_MEAN_LOGPROB  # escalate answers scoring under this
    escalate_on_context: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FIELDS = ("name", "small", "large", "min_mean_logprob", "escalate_on_context")


def validate_route(body: Any) -> CascadeRoute:
    """A `POST /admin/v1/routes` body, or a 400 naming the field. Whether `small` and `large` are
    deployed is the caller's to check (it knows the platform)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(FIELDS)}.", unknown[0])
    names = {}
    for field in ("name", "small", "large"):
        value = body.get(field)
        if not isinstance(value, str) or not NAME.fullmatch(value):
            what = "the route's name" if field == "name" else "a deployment's name"
            raise invalid(
                f"'{field}' must be {what}: 1-63 lowercase letters, digits, '.', '_' or '-', starting "
                f"with a letter or digit; got {value!r}.",
                field,
            )
        names[field] = value
    if names["small"] == names["large"]:
        raise invalid(f"'large' must be another deployment than 'small' ({names['small']!r}).", "large")
    if names["name"] in (names["small"], names["large"]):
        raise invalid(f"'name' must differ from the deployments it routes to, got {names['name']!r}.", "name")
    threshold = body.get("min_mean_logprob", DEFAULT_MIN_MEAN_LOGPROB)
    if threshold is None:
        threshold = DEFAULT_MIN_MEAN_LOGPROB
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not math.isfinite(threshold)
        or not LOGPROB_FLOOR <= threshold <= 0
    ):
        raise invalid(
            f"'min_mean_logprob' must be a number in {LOGPROB_FLOOR:g}..0 (a mean token logprob), got {threshold!r}.",
            "min_mean_logprob",
        )
    context = body.get("escalate_on_context", True)
    if not isinstance(context, bool):
        raise invalid(f"'escalate_on_context' must be true or false, got {context!r}.", "escalate_on_context")
    return CascadeRoute(names["name"], names["small"], names["large"], float(threshold), context)


def route_schema() -> dict[str, Any]:
    """A route's JSON schema, as `validate_route` checks it: the admin API's OpenAPI description
    and the `StokerRoute` resource's schema (`stoker.spec.resources`) are made from it."""
    name = {"type": "string", "pattern": f"^{NAME.pattern}$"}
    return {
        "type": "object",
        "required": ["name", "small", "large"],
        "additionalProperties": False,
        "properties": {
            "name": {**name, "description": "what clients send as `model`; no deployment's name"},
            "small": {**name, "description": "the deployment that answers first"},
            "large": {**name, "description": "the deployment an unsure or too-long request goes to"},
            "min_mean_logprob": {
                "type": "number",
                "minimum": LOGPROB_FLOOR,
                "maximum": 0,
                "default": DEFAULT_MIN_MEAN_LOGPROB,
                "description": "escalate a small answer whose mean token logprob is under this",
            },
            "escalate_on_context": {"type": "boolean", "default": True},
        },
    }


def route_not_found(name: str) -> APIError:
    return APIError(
        404, f"No route named {name!r}.", type="not_found_error", param="name", code="route_not_found"
    )


# ---- judging an answer, and the requests the two sides get ---------------------------------------


def with_logprobs(parsed: dict, chat: bool) -> tuple[dict, bool]:
    """The request asking for logprobs, and whether they were added (to be taken out again).
    A request that asks for them already, or sets them in a way the engine must judge (a bad
    value, chat's `top_logprobs` without `logprobs`), goes as it is."""
    if chat:
        if parsed.get("logprobs") in (None, False) and not parsed.get("top_logprobs"):
            return {**parsed, "logprobs": True}, True
        return parsed, False
    if parsed.get("logprobs") is None:  # completions: an integer N; 0 gives the chosen token's only
        return {**parsed, "logprobs": 0}, True
    return parsed, False


def mean_logprob(answer: Any, skip_prompt: bool = False) -> float | None:
    """The lowest of the answer's choices' mean token logprobs (one unsure choice is enough to
    escalate), or None when no choice carries any. Chat's `logprobs.content[].logprob` and the
    legacy `logprobs.token_logprobs`; `skip_prompt` (a completion with `echo`) leaves out the
    first `usage.prompt_tokens` entries, the prompt's."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return None
    prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens") if skip_prompt else 0
    means = []
    for choice in answer["choices"]:
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(lp, dict):
            continue
        if isinstance(lp.get("content"), list):
            values = [e.get("logprob") for e in lp["content"] if isinstance(e, dict)]
        elif isinstance(lp.get("token_logprobs"), list):
            values = lp["token_logprobs"][prompt_tokens if isinstance(prompt_tokens, int) else 0 :]
        else:
            continue
        numbers = [
            max(float(v), LOGPROB_FLOOR)
            for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)
        ]
        if numbers:
            means.append(sum(numbers) / len(numbers))
    return min(means) if means else None


def without_logprobs(answer: dict) -> dict:
    """The answer as a request that did not ask for logprobs gets it."""
    for choice in answer.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None
    return answer


def context_exceeded(status: int, body: bytes) -> bool:
    """Whether an answer is an engine's "the prompt does not fit the context" 400: the CPU engine's
    (and OpenAI's) code `context_length_exceeded`; vLLM's messages "This model's maximum context
    length is …" and "The decoder prompt (length N) is longer than the maximum model length of M"."""
    if status != 400:
        return False
    try:
        error = json.loads(body)
    except ValueError:
        return False
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        error = error["error"]  # OpenAI's shape; vLLM's older one is the object itself
    if not isinstance(error, dict):
        return False
    message = error.get("message")
    message = message if isinstance(message, str) else ""
    return (
        error.get("code") == "context_length_exceeded"
        or "maximum context length" in message
        or "longer than the maximum model length" in message
    )


def prompt_tokens_at_least(parsed: dict) -> int:
    """A cheap estimate of the tokens a request needs, meant to undercount: the prompt's UTF-8 bytes
    / `BYTES_PER_TOKEN` (token ids count one each) plus `max_tokens` when given."""
    size = 0
    if isinstance(messages := parsed.get("messages"), list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            parts = content if isinstance(content, list) else [content]
            for part in parts:
                text = part.get("text") if isinstance(part, dict) else part
                size += len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0
    tokens = size // BYTES_PER_TOKEN
    prompt = parsed.get("prompt")
    if isinstance(prompt, str):
        tokens = len(prompt.encode("utf-8", "replace")) // BYTES_PER_TOKEN
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens = len(prompt)
    most = parsed.get("max_completion_tokens", parsed.get("max_tokens"))
    if isinstance(most, int) and not isinstance(most, bool) and most > 0:
        tokens += most
    return tokens


def context_of(snapshot_dir: Path, engine: str) -> int | None:
    """A deployment's context, from its snapshot's `max_position_embeddings` (or its text
    config's), capped at 4096 on the CPU engine as it caps it; None when config.json does not say."""
    try:
        config = json.loads((snapshot_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("max_position_embeddings")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("max_position_embeddings")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return None
    return min(value, 4096) if engine == "cpu" else value


# ---- the saving ---------------------------------------------------------------------------------


def saving(small_s: float, recent_large_s: deque[float] | list[float]) -> float | None:
    """Seconds an answer the small side gave in `small_s` saved against the large side's recent
    mean (negative: it cost that much more); None with nothing to compare with.
    E.g. large answers of 2.0, 3.0 and 4.0 s, a small answer in 0.5 s: 3.0 - 0.5 = 2.5 s saved."""
    if not recent_large_s:
        return None
    return sum(recent_large_s) / len(recent_large_s) - small_s
