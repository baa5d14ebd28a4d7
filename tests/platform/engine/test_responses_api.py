"""`/v1/responses` on a real engine, through the official client: the same generation as the chat
route's (same prompt tokens, same greedy text), `instructions` and item input, `text.format` as
JSON valid against its schema, function calls valid against their schemas and a function's output
sent back, the stream's events in order with their sequence numbers and deltas that add up to the
whole Response (also through the client's `responses.stream` helper), an answer cut by
`max_output_tokens` as `incomplete`, and what needs stored responses refused naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from stoker.engine.responses_api import parse_responses, renamed
from stoker.errors import invalid
from tests.platform.engine.test_tools import SCHEMAS, TIME_SCHEMA, WEATHER_SCHEMA

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER_SCHEMA},
    {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA, "strict": True},
]
CITY = {
    "type": "object",
    "properties": {"name": {"enum": ["Paris", "Lyon", "Nice"]}, "capital": {"type": "boolean"}},
    "required": ["name", "capital"],
    "additionalProperties": False,
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def test_text_input_is_the_chat_generation_answered_as_a_response(client):
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text == message.content[0].text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed") and message.status == r.status
    assert r.temperature == 0 and r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls


def test_item_input_and_instructions_are_the_chat_messages_they_mean(client):
    r = client.responses.create(
        model="tiny",
        instructions="Answer in one word.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": "And now?"},
        ],
        max_output_tokens=6,
        temperature=0,
        metadata={"job": "t1"},
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": "And now?"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Answer in one word." and r.metadata == {"job": "t1"}


def test_a_json_schema_text_format_gives_json_valid_against_it(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = client.responses.create(
        model="tiny", input="Name a city.", text={"format": fmt}, max_output_tokens=400, temperature=0
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    # Any object: random weights need not close it (a number can go on for ever), but it is one.
    plain = client.responses.create(
        model="tiny", input="Name a city.", text={"format": {"type": "json_object"}}, max_output_tokens=20,
        temperature=0,
    )  # fmt: skip
    assert plain.output_text.startswith("{") and plain.text.format.type == "json_object"


def function_calls(response) -> list:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_required_tools_give_function_calls_valid_against_their_schemas(client):
    r = client.responses.create(
        model="tiny", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300, temperature=1.0,
        extra_body={"seed": 1},
    )  # fmt: skip
    assert r.status == "completed" and 1 <= len(function_calls(r)) == len(r.output) <= 16
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tool_choice == "required"
    named = client.responses.create(
        model="tiny", input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False, max_output_tokens=300, temperature=1.0, extra_body={"seed": 2},
    )  # fmt: skip
    assert [c.name for c in function_calls(named)] == ["get_time"] and named.parallel_tool_calls is False


def test_a_function_s_output_goes_back_as_input(client):
    first = client.responses.create(
        model="tiny", input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=300, temperature=1.0, extra_body={"seed": 3},
    )  # fmt: skip
    [call] = function_calls(first)
    history = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
    ]
    r = client.responses.create(model="tiny", input=history, tools=TOOLS, max_output_tokens=5, temperature=0)
    assert r.usage.input_tokens > first.usage.input_tokens + len(call.arguments) // 4
    assert r.status in ("completed", "incomplete")


def test_the_stream_s_events_come_in_order_and_add_up_to_the_response(client):
    kwargs = {"model": "tiny", "input": "Hello", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", last
    ]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text == events[-4].text
    assert final.id == events[0].response.id and events[0].response.output == []
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status


def test_the_client_s_stream_helper_puts_text_and_calls_back_together(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY}
    kwargs = {"model": "tiny", "input": "Name a city.", "max_output_tokens": 400, "temperature": 0}
    with client.responses.stream(**kwargs, text={"format": fmt}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), CITY)
    call_kwargs = {"model": "tiny", "input": ASK, "tools": TOOLS, "tool_choice": "required",
                   "max_output_tokens": 300, "temperature": 1.0, "extra_body": {"seed": 4}}  # fmt: skip
    whole = client.responses.create(**call_kwargs)
    with client.responses.stream(**call_kwargs) as stream:
        arguments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in function_calls(streamed)] == [
        (c.name, c.arguments) for c in function_calls(whole)
    ]
    assert "".join(arguments) == "".join(c.arguments for c in function_calls(whole))


def test_an_answer_cut_by_max_output_tokens_is_incomplete(client):
    r = client.responses.create(
        model="tiny", input="Hello", max_output_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(
        client.responses.create(
            model="tiny", input="Hello", max_output_tokens=3, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"store": True}, "store", "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
        ({"background": True}, "background", "background"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "hosted tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "text only",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stored item"),
        ({"input": []}, "input", "input"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"include": ["message.output_text.logprobs"]}, "include", "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reason"),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}
                }
            },
            "text.format",
            "'text.format'",
        ),
        ({"temperature": 3}, "temperature", "temperature"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
    ],
)
def test_what_it_cannot_honour_is_refused_naming_the_field(engine, body, param, says):
    r = httpx.post(f"{engine.url}/v1/responses", json={"model": "tiny", "input": "Hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_store_false_and_fields_that_change_nothing_are_accepted(client):
    r = client.responses.create(
        model="tiny", input="Hi", store=False, user="u1", safety_identifier="s1", prompt_cache_key="k",
        truncation="disabled", include=[], max_output_tokens=2,
    )  # fmt: skip
    assert r.status in ("completed", "incomplete")


def test_calls_in_a_row_are_one_assistant_turn_and_outputs_are_tool_messages():
    req, echo = parse_responses(
        {
            "model": "tiny",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Two."}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": '{"city":"Rome"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny."},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "Rain."}],
                },
            ],
            "tools": TOOLS[:1],
            "max_output_tokens": 9,
        }
    )
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in req.messages[2]["tool_calls"]] == ["c1", "c2"] and req.messages[2][
        "content"
    ] == "Two."
    assert [m["content"] for m in req.messages[3:]] == ["Sunny.", "Rain."]
    assert req.params.max_tokens == 9 and req.tools.choice == "auto"
    assert (
        echo["tools"][0]["strict"] is True
        and echo["tool_choice"] == "auto"
        and echo["text"]["format"] == {"type": "text"}
    )


def test_a_refusal_in_chat_s_names_is_given_in_the_responses_names():
    error = renamed(invalid("'messages' is too long.", param="messages"))
    assert (error.param, error.message) == ("input", "'input' is too long.")
    error = renamed(invalid("'response_format' has a bad schema.", param="response_format"))
    assert (error.param, error.message) == ("text.format", "'text.format' has a bad schema.")
    assert renamed(invalid("x", param="temperature")).param == "temperature"
