"""Tool calls without an engine: `tools` parsing, the grammar of each `tool_choice` held against
texts through llguidance with the test model's tokenizer, and the reader of calls fed in pieces."""

from __future__ import annotations

import json

import pytest

from stoker.engine import tools
from stoker.engine.protocol import parse_request
from stoker.engine.tools import Arguments, CallReader, CallStart, Content
from stoker.errors import APIError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris"}')
ROME = call("get_weather", '{"city": "Rome", "days": 2}')
NOW = call("get_time", "{}")


def spec(choice=None, parallel=None, tool_list=(WEATHER, TIME)):
    body = {"tools": list(tool_list)}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return tools.parse_tools(body)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])


def accepts(llg_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` and then the end of the answer."""
    import llguidance

    matcher = llguidance.LLMatcher(
        llg_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.consume_token(tokenizer.eos_token_id)


# (tool_choice, parallel_tool_calls, text, accepted)
TEXTS = [
    ("auto", None, "It is sunny.", True),
    ("auto", None, PARIS, True),
    ("auto", None, "Let me look. " + PARIS, True),
    ("auto", None, PARIS + "\n" + NOW, True),
    ("auto", None, "Let me look. <tool_call>\nsunny", False),  # once the call opens, only a call
    ("auto", None, PARIS + " and more text", False),
    ("auto", None, call("get_weather", '{"town": "Paris"}'), False),  # not the function's schema
    ("auto", None, call("get_weather", '{"city": "Paris", "days": 0}'), False),  # minimum 1
    ("auto", None, call("set_weather", '{"city": "Paris"}'), False),  # no such function
    ("auto", False, PARIS + "\n" + ROME, False),  # one call only
    ("required", None, PARIS + "\n" + ROME + "\n" + NOW, True),
    ("required", None, "It is sunny.", False),
    ("required", None, "Sure. " + PARIS, False),
    ({"type": "function", "function": {"name": "get_time"}}, None, NOW, True),
    ({"type": "function", "function": {"name": "get_time"}}, None, PARIS, False),
    ({"type": "function", "function": {"name": "get_time"}}, False, NOW + "\n" + NOW, False),
]


@pytest.mark.parametrize(("choice", "parallel", "text", "accepted"), TEXTS)
def test_each_tool_choice_takes_what_it_allows(llg_tokenizer, tokenizer, choice, parallel, text, accepted):
    assert accepts(llg_tokenizer, tokenizer, spec(choice, parallel).grammar(), text) is accepted


def test_parallel_calls_stop_at_the_bound(llg_tokenizer, tokenizer):
    grammar = spec("required").grammar()
    assert accepts(llg_tokenizer, tokenizer, grammar, "\n".join([NOW] * tools.MAX_CALLS))
    assert not accepts(llg_tokenizer, tokenizer, grammar, "\n".join([NOW] * (tools.MAX_CALLS + 1)))


def test_a_response_format_shapes_the_text_of_an_auto_answer(llg_tokenizer, tokenizer):
    grammar = spec("auto").grammar('{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}')
    assert accepts(llg_tokenizer, tokenizer, grammar, '{"a": 1}')
    assert accepts(llg_tokenizer, tokenizer, grammar, PARIS)
    assert not accepts(llg_tokenizer, tokenizer, grammar, "It is sunny.")


CUTS = [1, 2, 3, 5, 7, 1000]  # the answer fed in pieces of these sizes


@pytest.mark.parametrize("size", CUTS)
def test_the_reader_finds_content_and_calls_however_the_text_is_cut(size):
    text = "Let me look <tool" + PARIS[len("<tool") :] + "\n" + call("get_time", '{"note": "a } \\" {"}')
    reader = CallReader(spec("auto"))
    events = []
    for at in range(0, len(text), size):
        events += reader.feed(text[at : at + size])
    events += reader.close()
    assert "".join(e.text for e in events if isinstance(e, Content)) == "Let me look "
    assert [(e.index, e.name) for e in events if isinstance(e, CallStart)] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    for index, expected in ((0, '{"city": "Paris"}'), (1, '{"note": "a } \\" {"}')):
        streamed = "".join(e.text for e in events if isinstance(e, Arguments) and e.index == index)
        assert streamed == expected == reader.calls[index]["function"]["arguments"]
        json.loads(streamed)
    ids = [c["id"] for c in reader.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_text_that_only_looked_like_a_call_is_content_at_the_end():
    reader = CallReader(spec("auto"))
    assert reader.feed("a <tool_c") == [Content("a ")]
    assert reader.close() == [Content("<tool_c")]
    assert reader.calls == []


def test_a_call_cut_short_keeps_the_arguments_written():
    reader = CallReader(spec("required"))
    reader.feed(PARIS[: PARIS.index("Par")])
    assert reader.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "'}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0]",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 5000}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0]"),
        ({"tools": [TIME, TIME]}, "tools"),
        ({"tools": [TIME] * (tools.MAX_TOOLS + 1)}, "tools"),
        ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "name": "a b"}]}, "messages[0].name"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body, param):
    with pytest.raises(APIError) as err:
        parse_request("chat", {"model": "m", "messages": MESSAGES, **body})
    assert err.value.status == 400 and err.value.param == param


def test_completions_take_no_tools():
    with pytest.raises(APIError) as err:
        parse_request("completion", {"model": "m", "prompt": "x", "tools": [TIME]})
    assert err.value.param == "tools"


def test_a_conversation_with_past_calls_is_handed_to_a_template_without_tools_written_out():
    body = {
        "model": "m",
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "Be brief."},
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    }  # fmt: skip
    req = parse_request("chat", body)
    plain = tools.template_messages(req.messages, req.tools, template_has_tools=False)
    assert (
        plain[0]["role"] == "system"
        and "get_weather" in plain[0]["content"]
        and "Be brief." in plain[0]["content"]
    )
    assert plain[2] == {"role": "assistant", "content": PARIS}
    assert plain[3] == {"role": "tool", "content": "sunny"}
    rich = tools.template_messages(req.messages, req.tools, template_has_tools=True)
    assert rich[0] == {"role": "system", "content": "Be brief."}
    assert rich[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }  # an object, as templates take
    assert rich[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_tool_choice_none_leaves_the_answer_unconstrained():
    req = parse_request(
        "chat", {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"}
    )
    assert req.tools is not None and req.params.response_format is None
    req = parse_request("chat", {"model": "m", "messages": MESSAGES, "tools": [WEATHER]})
    assert req.tools.choice == "auto" and req.params.response_format.kind == "tool_calls"
