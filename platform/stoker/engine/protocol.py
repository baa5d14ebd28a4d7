"""OpenAI request parsing and response shapes for `/v1/chat/completions` and `/v1/completions`.

Parsing turns an untrusted JSON body into a frozen `GenerationRequest` or raises `APIError` (400)
naming the offending field. Fields OpenAI defines but this engine cannot honour (`n` > 1,
`logprobs`, tools) are refused rather than silently ignored; unknown extra fields are ignored, as
vLLM and OpenAI do.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from stoker.openai_errors import APIError, invalid

Kind = Literal["chat", "completion"]
MAX_STOP_SEQUENCES = 4
ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None  # None: up to the context window
    temperature: float  # 0 means greedy
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool = False  # vLLM's extension: generate to max_tokens even past EOS (benchmarks, tests)


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    model: str
    messages: tuple[dict, ...] | None
    prompt: str | tuple[int, ...] | None
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_request(kind: Kind, body: dict, defaults: Mapping[str, float] | None = None) -> GenerationRequest:
    """Validate a request body. `defaults` (the model's generation_config: temperature, top_p) stand
    in for the sampling parameters the request leaves out, as vLLM applies them."""
    defaults = defaults or {}
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", param="model")
    messages = prompt = None
    if kind == "chat":
        messages = _messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    _refuse_unsupported(body)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        include_usage = _bool(options, "include_usage", False, prefix="stream_options.")
    params = SamplingParams(
        max_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0), 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0), 0.0, 1.0, open_low=True),
        stop=_stop(body.get("stop")),
        seed=_seed(body.get("seed")),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    return GenerationRequest(kind, model, messages, prompt, params, stream, include_usage)


def _messages(value: Any) -> tuple[dict, ...]:
    if value is None:
        raise invalid("'messages' is required.", param="messages")
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty array of message objects.", param="messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"'{where}' must be an object.", param=where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:  # an object or array is unhashable
            raise invalid(
                f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}.", param=f"{where}.role"
            )
        out.append({"role": role, "content": _content(msg.get("content"), f"{where}.content")})
    return tuple(out)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text is meaningful to a text model
        texts = []
        for j, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f"'{where}[{j}]' must be a text part {{'type': 'text', 'text': ...}}.", param=where
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"'{where}' must be a string or an array of text parts.", param=where)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if value is None:
        raise invalid("'prompt' is required.", param="prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if value == []:
        raise invalid("The prompt cannot be empty: 'prompt' has no token ids.", param="prompt")
    if isinstance(value, list) and all(type(t) is int and t >= 0 for t in value):
        return tuple(value)
    raise invalid(
        "'prompt' must be a string, or an array of token ids (one prompt per request).", param="prompt"
    )


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n is not None and (type(n) is not int or n != 1):
        raise invalid(f"'n' must be 1 on this engine, got {n!r}.", param="n")
    for name in ("logprobs", "top_logprobs", "echo", "tools", "functions", "suffix"):
        if body.get(name) not in (None, False, ""):
            raise invalid(f"'{name}' is not supported by this engine.", param=name)
    if body.get("best_of") not in (None, 1):
        raise invalid("'best_of' must be 1 on this engine.", param="best_of")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid(
            "'response_format' other than {'type': 'text'} is not supported.", param="response_format"
        )


def _bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{prefix}{name}' must be a boolean, got {value!r}.", param=prefix + name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a number, got {value!r}.", param=name)
    too_low = value <= low if open_low else value < low
    if too_low or value > high:
        bracket = "(" if open_low else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}.", param=name)
    return float(value)


def _max_tokens(body: dict) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise invalid(f"'{name}' must be an integer, got {value!r}.", param=name)
    if value <= 0:
        raise invalid(f"'{name}' must be at least 1, got {value}.", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise invalid("'stop' must be a non-empty string or an array of non-empty strings.", param="stop")
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}.", param="stop")
    return tuple(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not -(2**63) <= value < 2**64:
        raise invalid(f"'seed' must be an integer, got {value!r}.", param="seed")
    return value


# ---- responses -------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the response objects of one request, chat or completion, whole or streamed."""

    def __init__(self, kind: Kind, request_id: str, model: str) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(self.object, [choice], usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def ensure_served(model: str, served: str) -> None:
    if model != served:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This engine serves `{served}`.",
            param="model",
            code="model_not_found",
        )
