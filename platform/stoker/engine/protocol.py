"""OpenAI request parsing for `/v1/chat/completions` and `/v1/completions`.

Parsing turns an untrusted JSON body into a frozen `GenerationRequest` or raises `APIError` (400)
naming the offending field. Our rule is that nothing a client sends is ignored silently: every
parameter OpenAI defines is either honoured or refused with a 400 naming it. Honoured, with the
ranges OpenAI (or vLLM, for its extensions) enforces:

| parameter | range | how (engine side: `draw.py`, `structured.py`) |
|---|---|---|
| `temperature`, `top_p` | [0, 2], (0, 1] | per request, in the draw step (`draw.py`); 0 is greedy |
| `seed`, `stop`, `max_tokens`/`max_completion_tokens` | OpenAI's | a generator per request; text.py; the manager |
| `presence_penalty`, `frequency_penalty` | [-2, 2] | subtracted per generated token, as OpenAI and vLLM define them |
| `logit_bias` | token id strings → [-100, 100], at most 300 | added to the logits |
| `logprobs` + `top_logprobs` (chat) | `true`, 0..20 | raw log-probabilities (vLLM's default) |
| `logprobs` (completions) | 0..5 | the same, in the legacy shape |
| `response_format` | `text`, `json_object`, `json_schema` | a grammar (llguidance) masks each token |
| vLLM's `top_k` | -1 or 0 = off, else ≥ 1 | per request |
| vLLM's `min_tokens` | 0..max_tokens | EOS suppressed (and stop strings ignored) until reached |
| vLLM's `repetition_penalty` | > 0 | divides (or multiplies) logits of tokens seen in prompt or output |
| vLLM's `ignore_eos` | bool | generate to max_tokens |
| `n` | 1..`MAX_N` (16), at most the engine's `--max-num-seqs` | n sequences in the batch, each its own slot; a `seed` s gives sequence i the seed s + i |
| `tools`, `tool_choice`, `parallel_tool_calls` (chat) | OpenAI's | the prompt's tools and a grammar of calls (`tools.py`) |
| vLLM's `priority` | -1000..1000 (`stoker.spec.priority`) | the admission queue serves the lowest first (`admission.py`) |

Refused (400 naming the field): `best_of` other than 1, `echo`, `suffix`, the deprecated
`functions` and `function_call` (`tools` replaces them), tools on completions,
`audio` and `modalities` other than text, `prediction`, `web_search_options`, `reasoning_effort`,
`verbosity`, `moderation`, `store: true`, `service_tier` other than auto/default, and the vLLM
sampling extensions this engine does not implement (`min_p`, `stop_token_ids`, `bad_words`,
`allowed_token_ids`, `prompt_logprobs`, guided decoding's `guided_*` and `structured_outputs`, beam
search, ...). Fields that do not change the answer (`user`, `metadata`, `safety_identifier`,
`prompt_cache_key`, `prompt_cache_options`, `prompt_cache_retention`) are accepted; names neither
OpenAI nor vLLM define are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stoker.engine import tools
from stoker.engine.tools import ToolSpec
from stoker.errors import APIError, invalid
from stoker.spec import priority as priority_spec

Kind = Literal["chat", "completion"]
MAX_STOP_SEQUENCES = 4
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs`, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' `logprobs`, as OpenAI allows
MAX_N = 16  # choices a request may ask for: each one holds a slot of the engine's batch
ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name

# Set to anything but these (None, or the value shown) and the field is refused: OpenAI's fields
# this engine cannot honour, then vLLM's sampling extensions it does not implement.
REFUSED: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "functions": (),
    "function_call": (),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "moderation": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "min_p": (0, 0.0),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "prompt_logprobs": (),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
}


@dataclass(frozen=True)
class ResponseFormat:
    """A structured-output constraint: `json_object` (any JSON object), `json_schema`, or
    `tool_calls` (the grammar of an answer with tools, `tools.ToolSpec.grammar`)."""

    kind: Literal["json_object", "json_schema", "tool_calls"]
    source: str  # the JSON Schema or the Lark grammar, serialised: immutable, as a frozen request holds


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None  # None: up to the context window
    temperature: float  # 0 means greedy
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool = False  # vLLM's extension: generate to max_tokens even past EOS (benchmarks, tests)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    top_k: int = 0  # 0: off
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's and the N most likely
    response_format: ResponseFormat | None = None
    priority: int = 0  # vLLM's: lower is admitted first (`admission.py`)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    model: str
    messages: tuple[dict, ...] | None
    prompt: str | tuple[int, ...] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices: n sequences from the one prompt
    tools: ToolSpec | None = None  # chat only: the tools the prompt offers and how calls are read


def parse_request(kind: Kind, body: dict, defaults: Mapping[str, float] | None = None) -> GenerationRequest:
    """Validate a request body. `defaults` (the model's generation_config: temperature, top_p) stand
    in for the sampling parameters the request leaves out, as vLLM applies them."""
    defaults = defaults or {}
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", param="model")
    messages = prompt = spec = None
    _refuse_unsupported(body)
    if kind == "chat":
        messages = _messages(body.get("messages"))
        spec = tools.parse_tools(body)
    else:
        prompt = _prompt(body.get("prompt"))
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise invalid(f"'{name}' is a chat parameter: completions take no tools.", param=name)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        include_usage = _bool(options, "include_usage", False, prefix="stream_options.")
    max_tokens = _max_tokens(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0), 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0), 0.0, 1.0, open_low=True),
        stop=_stop(body.get("stop")),
        seed=_seed(body.get("seed")),
        ignore_eos=_bool(body, "ignore_eos", False),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, math.inf, open_low=True),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=_min_tokens(body, max_tokens),
        top_k=_top_k(body.get("top_k")),
        logprobs=_chat_logprobs(body) if kind == "chat" else _completion_logprobs(body),
        response_format=_constraint(_response_format(body.get("response_format")), spec),
        priority=priority_spec.of_request(body.get("priority"), None, None),
    )
    n = _n(body.get("n"))
    return GenerationRequest(kind, model, messages, prompt, params, stream, include_usage, n, spec)


def _constraint(fmt: ResponseFormat | None, spec: ToolSpec | None) -> ResponseFormat | None:
    """The grammar an answer follows: its tools' (with the response format for its text, where it
    may write text), or its response format alone."""
    if spec is None or not spec.constrained:
        return fmt
    return ResponseFormat("tool_calls", spec.grammar(fmt.source if fmt is not None else None))


def _n(value: Any) -> int:
    if value is None:
        return 1
    if type(value) is not int or not 1 <= value <= MAX_N:
        raise invalid(f"'n' must be an integer from 1 to {MAX_N}, got {value!r}.", param="n")
    return value


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
        out.append(_message(msg, role, where))
    return tuple(out)


def _message(msg: dict, role: str, where: str) -> dict:
    """One message as the chat template gets it: its role and text, an assistant's past tool calls
    (its content may then be empty), a tool result's `tool_call_id`, a participant's `name`."""
    out: dict[str, Any] = {"role": role}
    calls = msg.get("tool_calls")
    if calls is not None and role != "assistant":
        raise invalid(
            f"'{where}.tool_calls' is only allowed on an assistant message.", param=f"{where}.tool_calls"
        )
    if calls is not None:
        out["tool_calls"] = tools.assistant_calls(calls, f"{where}.tool_calls")
    content = msg.get("content")
    out["content"] = "" if content is None and calls else _content(content, f"{where}.content")
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(
                f"'{where}.tool_call_id' is required on a tool message.", param=f"{where}.tool_call_id"
            )
        out["tool_call_id"] = call_id
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str) or not tools.NAME.fullmatch(name):
            raise invalid(
                f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'.", param=f"{where}.name"
            )
        out["name"] = name
    return out


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
    if body.get("best_of") not in (None, 1):
        raise invalid("'best_of' must be 1 on this engine.", param="best_of")
    for name, allowed in REFUSED.items():
        value = body.get(name)
        if value is not None and not any(_same(value, ok) for ok in allowed):
            raise invalid(f"'{name}' is not supported by this engine.", param=name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("'modalities' must be [\"text\"] on this engine.", param="modalities")


def _same(value: Any, allowed: Any) -> bool:
    # `False == 0` in Python: compare types too, so `min_p: false` is refused like any other non-number.
    return type(value) is type(allowed) and value == allowed


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
        if high == math.inf:
            raise invalid(f"'{name}' must be greater than {low}, got {value}.", param=name)
        bracket = "(" if open_low else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}.", param=name)
    return float(value)


def _int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and type(value) is not int:
        raise invalid(f"'{name}' must be an integer, got {value!r}.", param=name)
    return value


def _max_tokens(body: dict) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _int(body, name)
    if value is not None and value <= 0:
        raise invalid(f"'{name}' must be at least 1, got {value}.", param=name)
    return value


def _min_tokens(body: dict, max_tokens: int | None) -> int:
    value = _int(body, "min_tokens")
    if value is None:
        return 0
    if value < 0:
        raise invalid(f"'min_tokens' must be at least 0, got {value}.", param="min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise invalid(
            f"'min_tokens' ({value}) must be at most 'max_tokens' ({max_tokens}).", param="min_tokens"
        )
    return value


def _top_k(value: Any) -> int:
    if value is None:
        return 0
    if type(value) is not int or value < -1:
        raise invalid(
            f"'top_k' must be -1 or 0 (off), or an integer of at least 1, got {value!r}.", param="top_k"
        )
    return max(value, 0)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (as a string) to a bias in [-100, 100]. Ids beyond the vocabulary
    are refused by the engine, which knows its size."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to numbers.", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}.", param="logit_bias"
        )
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(f"'logit_bias' keys must be token ids, got {key[:20]!r}.", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise invalid(
                f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for token {key}.",
                param="logit_bias",
            )
        out.append((int(key), float(bias)))
    return tuple(out)


def _chat_logprobs(body: dict) -> int | None:
    enabled = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}.", param="top_logprobs")
    if top and not enabled:
        raise invalid("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    return (top or 0) if enabled else None


def _completion_logprobs(body: dict) -> int | None:
    if body.get("top_logprobs") is not None:
        raise invalid(
            "'top_logprobs' is a chat parameter; completions take 'logprobs': N.", param="top_logprobs"
        )
    value = _int(body, "logprobs")
    if value is not None and not 0 <= value <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}], got {value}.", param="logprobs")
    return value


def _response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's `response_format`. The schema itself is checked where it is compiled (a 400 too);
    here only the envelope."""
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", '{"type": "object"}')
    if kind != "json_schema":
        raise invalid(
            "'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
            "{'type': 'json_schema', 'json_schema': {...}}.",
            param=param,
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("'response_format.json_schema' must be an object.", param=param)
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise invalid(
            "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'.", param=param
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("'response_format.json_schema.strict' must be a boolean.", param=param)
    schema = spec.get("schema", {})  # OpenAI's `schema` is optional: then any JSON value
    if not isinstance(schema, dict):
        raise invalid("'response_format.json_schema.schema' must be a JSON Schema object.", param=param)
    return ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":")))


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


def ensure_served(model: str, served: str) -> None:
    if model != served:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This engine serves `{served}`.",
            param="model",
            code="model_not_found",
        )


def sampling_defaults(snapshot_dir: Path) -> dict[str, float]:
    """The sampling parameters the snapshot's generation_config.json sets (temperature, top_p): the
    defaults for requests that leave them out, as vLLM applies them. Values out of range are ignored."""
    try:
        config = json.loads((snapshot_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    limits = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
    out = {}
    for key, (low, high) in limits.items():
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
            out[key] = float(value)
    if out.get("top_p") == 0.0:
        del out["top_p"]
    return out
