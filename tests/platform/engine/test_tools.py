"""Tool calls on a real engine, through the official client: every call's arguments valid against
its function's schema, each `tool_choice`, parallel calls, the stream's tool-call deltas adding up
to the whole answer, a conversation carrying its past calls and results, and a schema the engine
cannot enforce refused on `tools`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER_SCHEMA},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gets_calls_valid_against_their_schemas(client, seed):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=seed,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    assert 1 <= len(valid_calls(choice.message.tool_calls)) <= 16


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client):
    for seed in (4, 5):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        assert [name for name, _ in valid_calls(r.choices[0].message.tool_calls)] == ["get_time"]


def test_auto_answers_text_or_valid_calls(client):
    for seed in (6, 7):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=40, temperature=1.0, seed=seed
        )
        message = r.choices[0].message
        if message.tool_calls:
            valid_calls(message.tool_calls)
            assert r.choices[0].finish_reason in ("tool_calls", "length")
        else:
            assert "<tool_call>" not in (message.content or "")


def test_none_puts_the_tools_in_the_prompt_and_reads_no_calls(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, temperature=0)
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are described to the model
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_stream_sends_tool_call_deltas_that_add_up_to_the_whole_answer(client):
    kwargs = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300,
              "temperature": 1.0, "seed": 8}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its id, type and name, no arguments yet
                assert (
                    delta.index not in calls and delta.type == "function" and delta.function.arguments == ""
                )
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert sorted(calls) == list(range(len(whole)))
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert sum(len(c.choices[0].delta.tool_calls or []) > 1 for c in chunks) == 0  # one call per delta


def test_n_choices_each_get_their_own_calls(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=2,
        max_tokens=300,
        temperature=1.0,
        seed=9,
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        valid_calls(choice.message.tool_calls)


def test_a_conversation_carries_its_past_calls_and_their_results(client):
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=300, temperature=1.0, seed=10,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=5, temperature=0
    )
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 4
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_schema_the_engine_cannot_enforce_is_refused_on_tools(client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=bad, tool_choice="required", max_tokens=5
        )
    assert err.value.body["param"] == "tools" and "not" in err.value.body["message"]
