"""`POST /v1/responses`, the stateless part: a Responses request read as a chat request.

    body ──parse_responses──▶ a chat body ──protocol.parse_request──▶ GenerationRequest, + the echo
    the generation's text ──response_events.ResponseRun──▶ the stream's events, then the Response

Nothing new runs underneath: the request becomes the chat request it means, so the chat template,
the sampling, the grammars of `text.format` and of tools, the limits and the metrics are the chat
route's. What is translated:

| Responses | chat |
|---|---|
| `instructions` | a system message, first |
| `input`: a string | one user message |
| `input`: messages (`user`, `assistant`, `system`, `developer`; content a string or `input_text` / `output_text` / `refusal` parts) | messages |
| `input`: `function_call` items `{call_id, name, arguments}` | the assistant message's `tool_calls` (calls in a row join the assistant message before them) |
| `input`: `function_call_output` items `{call_id, output}` | `tool` messages |
| `tools`: `{type: "function", name, description, parameters, strict}` | `{type: "function", function: {...}}` |
| `tool_choice`: `none` / `auto` / `required` / `{type: "function", name}` | the same, nested as chat nests it |
| `text.format`: `text` / `json_object` / `{type: "json_schema", name, schema, strict}` | `response_format` |
| `max_output_tokens` | `max_tokens` |
| `temperature`, `top_p`, `parallel_tool_calls`, `stream`; vLLM's `seed`, `top_k`, `stop`, ... | themselves |

A refusal the chat parser or the engine writes names the Responses field (`renamed`): `input`, not
`messages`. Every input is bounded as a chat request's is: the body's size, then the same limits.

Stoker keeps no responses, so what needs a stored one is refused (400 naming the field): `store:
true` (OpenAI's default is true, but its clients send `store` only when it is set, so a request
that leaves it out is answered and forgotten, as one with `store: false`), `previous_response_id`,
`conversation`, `background`, `prompt` (a stored prompt), `item_reference` input items. Refused too,
because they would change the answer and this engine cannot honour them: hosted tools (web search,
files, MCP, ...), `include`, `reasoning`, `truncation: "auto"`, `max_tool_calls`, `top_logprobs`,
`text.verbosity`, images and files in the input. `metadata`, `user`, `safety_identifier` and the
prompt cache's hints change nothing and are accepted; `metadata` is echoed back, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stoker.engine import tools
from stoker.engine.protocol import REFUSED, SCHEMA_NAME, GenerationRequest, parse_request
from stoker.errors import APIError, invalid

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type: its text field
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on `metadata`
TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})
# The chat parameters a Responses body may carry as they are: OpenAI's sampling, vLLM's extensions
# the engine implements, and the names the chat parser refuses (so they are refused here too).
PASSED = (
    *("temperature", "top_p", "seed", "top_k", "min_tokens", "repetition_penalty", "stop", "ignore_eos"),
    *("presence_penalty", "frequency_penalty", "logit_bias"),
    *(name for name in REFUSED if name not in ("store", "service_tier")),
)
NO_STORAGE = (
    "Stoker keeps no responses: send 'store': false or leave it out (each response is answered and "
    "forgotten)."
)
NOT_KEPT = "Stoker keeps no responses to continue from: send the whole conversation as 'input'."
# Set to anything but these (None, or the value shown) and the field is refused, with its reason.
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((False,), NO_STORAGE),
    "previous_response_id": ((), NOT_KEPT),
    "conversation": ((), NOT_KEPT),
    "background": ((False,), "Stoker keeps no responses to run in the background: leave out 'background'."),
    "background_options": ((), "Stoker keeps no responses to run in the background."),
    "prompt": ((), "Stoker keeps no stored prompts: send the prompt's text as 'instructions' and 'input'."),
    "include": (([],), "This engine has nothing to include: 'include' must be empty or left out."),
    "reasoning": (({},), "This engine does not reason before it answers: leave out 'reasoning'."),
    "truncation": (
        ("disabled",),
        "This engine does not truncate the input: 'truncation' must be 'disabled'.",
    ),
    "max_tool_calls": ((), "'max_tool_calls' is not supported by this engine: use 'parallel_tool_calls'."),
    "top_logprobs": ((0,), "'top_logprobs' is not supported on /v1/responses by this engine."),
    "service_tier": (("auto", "default"), "'service_tier' must be 'auto' or 'default' on this engine."),
    "context_management": (([],), "'context_management' is not supported by this engine."),
    "image": ((), "'image' is not supported by this engine."),
    "access_programs": ((), "'access_programs' is not supported by this engine."),
}
# Chat's names, as a refusal the chat parser or the engine writes names them, and the Responses' own.
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def parse_responses(
    body: dict, defaults: Mapping[str, float] | None = None
) -> tuple[GenerationRequest, dict]:
    """The chat request a Responses body means, and the fields its Response echoes back (the
    sampling's are added from the request, defaults applied). Raises `APIError` (400) naming the
    Responses field."""
    for name, (allowed, reason) in UNSERVED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(ok) and value == ok for ok in allowed):
            raise invalid(reason, param=name)
    chat: dict[str, Any] = {name: body[name] for name in PASSED if name in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string.", param="instructions")
    chat["model"] = body.get("model")
    chat["messages"] = _messages(body.get("input"), instructions)
    chat["tools"], tools_echo = _tools(body.get("tools"))
    chat["tool_choice"], choice_echo = _tool_choice(body.get("tool_choice"))
    chat["parallel_tool_calls"] = body.get("parallel_tool_calls")
    chat["response_format"], text_echo = _text(body.get("text"))
    most = body.get("max_output_tokens")
    if most is not None and (type(most) is not int or most < 1):
        raise invalid(f"'max_output_tokens' must be an integer of at least 1, got {most!r}.",
                      param="max_output_tokens")  # fmt: skip
    chat["max_tokens"] = most
    chat["stream"] = body.get("stream")
    _stream_options(body.get("stream_options"), body.get("stream") is True)
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise invalid(f"'{name}' must be a string.", param=name)
    try:
        req = parse_request("chat", {k: v for k, v in chat.items() if v is not None}, defaults)
    except APIError as exc:
        raise renamed(exc) from None
    echo = {
        "instructions": instructions,
        "metadata": _metadata(body.get("metadata")),
        "parallel_tool_calls": req.tools.parallel if req.tools is not None else chat["parallel_tool_calls"] is not False,
        "temperature": req.params.temperature,
        "top_p": req.params.top_p,
        "tool_choice": choice_echo,
        "tools": tools_echo,
        "text": text_echo,
        "max_output_tokens": most,
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "default",
        "store": False,
        "truncation": "disabled",
        "background": False,
        "top_logprobs": 0,
        "user": body.get("user"),
    }  # fmt: skip
    return req, echo


def renamed(exc: APIError) -> APIError:
    """A refusal written in chat's names (by the chat parser, or by the engine: the prompt's
    context, a schema it cannot enforce), in the Responses request's."""
    param = exc.param or ""
    for chat_name, name in RENAMED.items():
        if param == chat_name or param.startswith((chat_name + "[", chat_name + ".")):
            message = exc.message.replace(f"'{chat_name}", f"'{name}")
            return APIError(
                exc.status, message, type=exc.type, param=name, code=exc.code, headers=exc.headers
            )
    return exc


def _messages(value: Any, instructions: str | None) -> list[dict]:
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        return [*out, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("'input' is required: a string, or a non-empty array of input items.", param="input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{where}' must be an object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _call(item, where)
            if out and out[-1]["role"] == "assistant":  # the calls of one answer: one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            out.append(
                {"role": "tool", "tool_call_id": call_id, "content": _output(item.get("output"), where)}
            )
        elif kind == "item_reference":
            raise invalid(f"'{where}' refers to a stored item: {NOT_KEPT}", param=where)
        else:
            raise invalid(
                f"'{where}.type' must be 'message', 'function_call' or 'function_call_output' on this "
                f"engine, got {str(kind)[:40]!r}.",
                param=f"{where}.type",
            )
    return out


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}.", param=f"{where}.role")
    return {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}


def _text_of(value: Any, where: str) -> str:
    """A message's text: a string, or text parts joined. An image, file or audio part is refused:
    this engine reads text only."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'{where}' must be a string or an array of content parts.", param=where)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        field = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None or not isinstance(part.get(field), str):
            raise invalid(
                f"'{where}[{j}]' must be a text part ({{'type': 'input_text', 'text': ...}}): this "
                f"engine reads text only, got type {str(kind)[:40]!r}.",
                param=f"{where}[{j}]",
            )
        texts.append(part[field])
    return "".join(texts)


def _call(item: dict, where: str) -> dict:
    name = _string(item, "name", where)
    if not tools.NAME.fullmatch(name):
        raise invalid(f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'.", param=f"{where}.name")
    call_id, arguments = _string(item, "call_id", where), _string(item, "arguments", where, empty=True)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _output(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    return _text_of(value, f"{where}.output")


def _string(item: dict, name: str, where: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise invalid(f"'{where}.{name}' is required and must be a string.", param=f"{where}.{name}")
    return value


def _tools(value: Any) -> tuple[list[dict] | None, list[dict]]:
    """Chat's `tools` for the Responses' flat function tools, and the Response's echo of them."""
    if value is None:
        return None, []
    if not isinstance(value, list) or not 1 <= len(value) <= tools.MAX_TOOLS:
        raise invalid(f"'tools' must be an array of 1 to {tools.MAX_TOOLS} tools.", param="tools")
    chat, echo = [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(
                f"'{where}' must be a function tool {{'type': 'function', 'name': ...}}: this engine "
                f"runs no hosted tools, got type {str(kind)[:40]!r}.",
                param=where,
            )
        extra = sorted(k for k, v in tool.items() if k not in TOOL_FIELDS and v is not None)
        if extra:
            raise invalid(f"'{where}.{extra[0][:40]}' is not supported by this engine.", param=where)
        name, description = tool.get("name"), tool.get("description")
        if not isinstance(name, str) or not tools.NAME.fullmatch(name):
            raise invalid(f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'.", param=where)
        if description is not None and (
            not isinstance(description, str) or len(description) > tools.MAX_DESCRIPTION
        ):
            raise invalid(f"'{where}.description' must be a string of at most {tools.MAX_DESCRIPTION} "
                          "characters.", param=where)  # fmt: skip
        strict, parameters = tool.get("strict"), tool.get("parameters")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"'{where}.strict' must be a boolean.", param=where)
        if parameters is not None and (
            not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
        ):
            raise invalid(f"'{where}.parameters' must be a JSON Schema of an object (type 'object').",
                          param=where)  # fmt: skip
        function = {"name": name, "description": description, "parameters": parameters}
        chat.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        # Strict or not, the arguments follow the schema: the grammar enforces it (`tools.py`).
        echo.append({"type": "function", **function, "strict": True if strict is None else strict})
    return chat, echo


def _tool_choice(value: Any) -> tuple[Any, Any]:
    """Chat's `tool_choice` for the Responses', and the Response's echo of it."""
    if value is None:
        return None, "auto"
    if value in ("none", "auto", "required"):
        return value, value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        name = value["name"]
        return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}
    raise invalid(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} on this "
        "engine (it runs no hosted tools).",
        param="tool_choice",
    )


def _text(value: Any) -> tuple[dict | None, dict]:
    """Chat's `response_format` for `text.format`, and the Response's echo of `text`."""
    plain = {"format": {"type": "text"}}
    if value is None:
        return None, plain
    if not isinstance(value, dict):
        raise invalid("'text' must be an object {'format': {...}}.", param="text")
    if value.get("verbosity") is not None:
        raise invalid("'text.verbosity' is not supported by this engine.", param="text.verbosity")
    fmt = value.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None, plain
    if kind == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}}
    if kind != "json_schema":
        raise invalid(
            "'text.format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
            "'name': ..., 'schema': {...}}.",
            param="text.format",
        )
    name, schema, strict = fmt.get("name"), fmt.get("schema"), fmt.get("strict")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise invalid(
            "'text.format.name' must be 1 to 64 letters, digits, '_' or '-'.", param="text.format.name"
        )
    if not isinstance(schema, dict):
        raise invalid("'text.format.schema' must be a JSON Schema object.", param="text.format.schema")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("'text.format.strict' must be a boolean.", param="text.format.strict")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid("'text.format.description' must be a string.", param="text.format.description")
    spec = {"name": name, "schema": schema, "strict": strict}
    echo = {
        "type": "json_schema",
        "name": name,
        "schema": schema,
        "strict": strict,
        "description": description,
    }
    return {"type": "json_schema", "json_schema": spec}, {"format": echo}


def _stream_options(value: Any, stream: bool) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("'stream_options' must be an object.", param="stream_options")
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    obfuscation = value.get("include_obfuscation")  # padding against length side channels: none sent
    if obfuscation is not None and not isinstance(obfuscation, bool):
        raise invalid("'stream_options.include_obfuscation' must be a boolean.",
                      param="stream_options.include_obfuscation")  # fmt: skip


def _metadata(value: Any) -> dict | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > METADATA_PAIRS
        or not all(isinstance(k, str) and len(k) <= METADATA_KEY for k in value)
        or not all(isinstance(v, str) and len(v) <= METADATA_VALUE for v in value.values())
    ):
        raise invalid(
            f"'metadata' must be an object of at most {METADATA_PAIRS} string pairs (keys of at most "
            f"{METADATA_KEY} characters, values of at most {METADATA_VALUE}).",
            param="metadata",
        )
    return value
