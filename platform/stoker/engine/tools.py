"""Tool calls on Stoker's engine: `tools` and `tool_choice` as a grammar, and the calls read back.

    request: tools + tool_choice ──▶ ToolSpec ──▶ the prompt (the chat template's `tools`, or the
                                          │        system message below where the template has none)
                                          └──────▶ a Lark grammar (llguidance) that masks each token
    answer:  text ──▶ CallReader ──▶ content, then each call's id, name and arguments as they come

The model writes a call in the Hermes form that Qwen, Hermes and SmolLM3 are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar fixes everything but the arguments, which follow the named function's own JSON
Schema (`parameters`), so every call parses and is valid against it:

| `tool_choice` | the answer may be |
|---|---|
| `none` | text; the tools are still in the prompt (as vLLM does), and nothing is read back as a call |
| `auto` (the default with tools) | text, or text followed by calls: once `<tool_call>` is written, only calls can follow (llguidance's lazy lexeme ends the text there) |
| `required` | calls only, to any of the tools |
| `{"type": "function", "function": {"name": N}}` | calls to N only |

With `parallel_tool_calls: false` the answer holds one call; otherwise up to `MAX_CALLS`, each on
its own line, then the end of the answer. A `response_format` constrains the text of `auto` and
`none` answers; an `auto` answer is then its JSON or calls, with no text before the calls. An answer cut by `max_tokens` in the middle of a call keeps that call with the
arguments written so far, and ends with `finish_reason: "length"`, as the stream had sent them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from stoker.errors import invalid

MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_CALLS = 16  # calls in one answer: bounds what the grammar lets a model loop on
MAX_DESCRIPTION = 4096  # characters of one function's description
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD, MID, TAIL = '\n{"name": "', '", "arguments": ', "}\n" + CLOSE
# Whitespace in the arguments: one space or none between tokens, as json.dumps writes it (compact or
# not). A model that wanders in whitespace (a small one does) would otherwise spend its max_tokens
# on blanks inside a call; arguments never need more.
WHITESPACE = {"whitespace_pattern": r"\x20?"}

Choice = Literal["none", "auto", "required"] | str  # a str other than these: the one function named


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: str  # its JSON Schema, serialised: a frozen request holds immutable values


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: Choice
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.choice != "none"

    def for_template(self) -> list[dict]:
        """The tools as chat templates take them (transformers' `tools=`: OpenAI's own shape)."""
        out = []
        for tool in self.tools:
            function: dict[str, Any] = {"name": tool.name, "parameters": json.loads(tool.parameters)}
            if tool.description is not None:
                function["description"] = tool.description
            out.append({"type": "function", "function": function})
        return out

    def grammar(self, text_schema: str | None = None) -> str:
        """The Lark grammar (llguidance's dialect) of an answer. `text_schema`: the response
        format's JSON Schema for the text of an `auto` answer, instead of any text."""
        chosen = [t for t in self.tools if self.choice in ("auto", "required") or t.name == self.choice]
        functions = " | ".join(f"fn_{i}" for i in range(len(chosen)))
        more = f" ({json.dumps(chr(10) + OPEN)} call){{0,{MAX_CALLS - 1}}}" if self.parallel else ""
        lines = ["%llguidance {}"]
        if self.choice == "auto" and text_schema is None:
            lines += ["start: TEXT | head calls", f"head[lazy]: TEXT {json.dumps(OPEN)}"]
        elif self.choice == "auto":  # JSON or calls, never both: no text before a call
            lines += [f"start: text | {json.dumps(OPEN)} calls", f"text: %json {text_schema}"]
        else:
            lines += [f"start: {json.dumps(OPEN)} calls"]
        lines += [
            f"calls: call{more}",
            f"call: {json.dumps(HEAD)} ({functions}) {json.dumps(TAIL)}",
            r"TEXT: /(.|\n)*/",
        ]
        for i, tool in enumerate(chosen):
            schema = {**json.loads(tool.parameters), "x-guidance": WHITESPACE}
            envelope = json.dumps(tool.name + MID)
            lines.append(f"fn_{i}: {envelope} %json {json.dumps(schema)}")
        return "\n".join(lines) + "\n"

    def system_prompt(self) -> str:
        """What the model is told where its chat template has no place for tools."""
        listed = json.dumps(self.for_template(), indent=1)
        return (
            "You may call functions to answer. To call one, write\n"
            f'{OPEN}\n{{"name": <function name>, "arguments": <its arguments as JSON>}}\n{CLOSE}\n'
            f"The functions:\n{listed}"
        )


def parse_tools(body: dict) -> ToolSpec | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None without tools.
    Raises `APIError` (400) naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid(
            f"'parallel_tool_calls' must be a boolean, got {parallel!r}.", param="parallel_tool_calls"
        )
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise invalid(f"'tools' must be an array of 1 to {MAX_TOOLS} tools.", param="tools")
    parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise invalid("'tools' has two functions of the same name.", param="tools")
    return ToolSpec(parsed, _choice(choice, names), parallel)


def _tool(value: Any, where: str) -> Tool:
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or not isinstance(value.get("function"), dict)
    ):
        raise invalid(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}.", param=where)
    function = value["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'.", param=where)
    description = function.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION):
        raise invalid(
            f"'{where}.function.description' must be a string of at most {MAX_DESCRIPTION} characters.",
            param=where,
        )
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise invalid(f"'{where}.function.strict' must be a boolean.", param=where)
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise invalid(
            f"'{where}.function.parameters' must be a JSON Schema of an object (type 'object').", param=where
        )
    # Arguments are a JSON object: a schema that leaves the type open is read as an object's.
    parameters = {"type": "object", **parameters}
    return Tool(name, description, json.dumps(parameters, separators=(",", ":")))


def _choice(value: Any, names: list[str]) -> Choice:
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
    ):
        name = value["function"].get("name")
        if name in names:
            return name
        raise invalid(f"'tool_choice' names function {str(name)[:64]!r}, which is not in 'tools'.",
                      param="tool_choice")  # fmt: skip
    raise invalid(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
        param="tool_choice",
    )


def assistant_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` (the history of a conversation), checked."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CALLS * 8:
        raise invalid(f"'{where}' must be a non-empty array of tool calls.", param=where)
    out = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
            or not isinstance(call.get("id", ""), str)
        ):
            raise invalid(
                f"'{where}[{i}]' must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                "'arguments': '<JSON>'}}.",
                param=where,
            )
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})  # fmt: skip
    return out


def template_messages(
    messages: tuple[dict, ...], spec: ToolSpec | None, template_has_tools: bool
) -> list[dict]:
    """The conversation as the chat template is handed it. A template with tools gets each past
    call's arguments as an object (Llama's and others' templates write them with `tojson`, as vLLM
    hands them); one without gets the tools in a system message and past calls written out."""
    out = []
    for msg in messages:
        msg = dict(msg)
        calls = msg.pop("tool_calls", None)
        if calls and template_has_tools:
            msg["tool_calls"] = [_with_object_arguments(c) for c in calls]
        elif calls:
            written = "\n".join(
                f'{OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}\n{CLOSE}'
                for c in calls
            )
            msg["content"] = ((msg.get("content") or "") + "\n" + written).lstrip("\n")
        if msg.get("content") is None:
            msg["content"] = ""
        if not template_has_tools:
            msg.pop("tool_call_id", None)
        out.append(msg)
    if spec is not None and not template_has_tools:
        prompt = spec.system_prompt()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_object_arguments(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**call["function"], "arguments": arguments}}


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


class CallReader:
    """Reads an answer's text as it comes, into content and calls. The grammar guarantees the
    envelope, so this only has to find its parts: the text before `<tool_call>` (held back while it
    could still be the start of one), each call's name, and its arguments (one JSON object: the
    reader counts its braces outside strings to know where it ends)."""

    def __init__(self, spec: ToolSpec) -> None:
        self._auto = spec.choice == "auto"
        self._buffer = ""
        self._state = "content" if self._auto else "open"
        self._depth = 0
        self._in_string = self._escaped = False
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self.content: list[str] = []

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return list(self._events())

    def close(self) -> list[Event]:
        """At the end of the answer: content still held back (an answer that ended on a prefix of
        `<tool_call>`) is content after all."""
        if self._state == "content" and self._buffer:
            text, self._buffer = self._buffer, ""
            self.content.append(text)
            return [Content(text)]
        return []

    def _events(self) -> Iterator[Event]:
        while self._buffer:
            if self._state == "content":
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = _held_back(self._buffer, OPEN)
                    text = self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(text) :]
                    if text:
                        self.content.append(text)
                        yield Content(text)
                    return
                if at:
                    self.content.append(self._buffer[:at])
                    yield Content(self._buffer[:at])
                self._buffer, self._state = self._buffer[at:], "open"
            elif self._state == "open":  # "<tool_call>" + HEAD + name + MID, then the arguments
                start = len(OPEN) + len(HEAD)
                end = self._buffer.find(MID, start)
                if not self._buffer.startswith(OPEN + HEAD) or end < 0:
                    return
                name = self._buffer[start:end]
                call_id = "call_" + uuid.uuid4().hex[:24]
                self.calls.append(
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
                )
                yield CallStart(len(self.calls) - 1, call_id, name)
                self._buffer, self._state, self._depth = self._buffer[end + len(MID) :], "arguments", 0
            elif self._state == "arguments":
                taken = self._scan()
                text, self._buffer = self._buffer[:taken], self._buffer[taken:]
                if text:
                    self.calls[-1]["function"]["arguments"] += text
                    yield Arguments(len(self.calls) - 1, text)
                if self._state == "arguments":
                    return
            else:  # "tail": TAIL, then "\n" and the next call, or the end of the answer
                if len(self._buffer) <= len(TAIL):
                    return
                self._buffer, self._state = self._buffer[len(TAIL) + 1 :], "open"

    def _scan(self) -> int:
        """How much of the buffer is still the arguments; moves to "tail" when the object closed."""
        for i, ch in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "tail"
                    return i + 1
        return len(self._buffer)


def _held_back(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`: it may be its start."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
