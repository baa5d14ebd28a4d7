"""Parsing of the sampling parameters beyond the basics: a table of what is honoured (and how it
reads) and what is refused with a 400 naming the parameter (pure, no model)."""

from __future__ import annotations

import json

import pytest

from stoker.engine.protocol import ResponseFormat, parse_request
from stoker.errors import APIError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

HONOURED = [
    # (kind, extra body, attribute of SamplingParams, value read)
    ("chat", {}, "presence_penalty", 0.0),
    ("chat", {"presence_penalty": 2}, "presence_penalty", 2.0),
    ("chat", {"presence_penalty": -2.0}, "presence_penalty", -2.0),
    ("chat", {"frequency_penalty": 1.5}, "frequency_penalty", 1.5),
    ("chat", {"repetition_penalty": 1.3}, "repetition_penalty", 1.3),
    ("chat", {"repetition_penalty": 0.5}, "repetition_penalty", 0.5),
    ("chat", {"logit_bias": {"5": 100, "7": -100.0}}, "logit_bias", ((5, 100.0), (7, -100.0))),
    ("chat", {"logit_bias": {}}, "logit_bias", ()),
    ("chat", {"logit_bias": {str(i): 1 for i in range(300)}}, "logit_bias", tuple((i, 1.0) for i in range(300))),
    ("chat", {"min_tokens": 3, "max_tokens": 3}, "min_tokens", 3),
    ("chat", {"min_tokens": 0}, "min_tokens", 0),
    ("chat", {"top_k": -1}, "top_k", 0),
    ("chat", {"top_k": 0}, "top_k", 0),
    ("chat", {"top_k": 40}, "top_k", 40),
    ("chat", {}, "logprobs", None),
    ("chat", {"logprobs": False}, "logprobs", None),
    ("chat", {"logprobs": True}, "logprobs", 0),
    ("chat", {"logprobs": True, "top_logprobs": 20}, "logprobs", 20),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "logprobs", None),
    ("completion", {"logprobs": 0}, "logprobs", 0),
    ("completion", {"logprobs": 5}, "logprobs", 5),
    ("chat", {"response_format": {"type": "text"}}, "response_format", None),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format",
     ResponseFormat("json_object", '{"type": "object"}')),
    ("completion", {"response_format": {"type": "json_schema", "json_schema": {"name": "a-b_1", "schema": SCHEMA, "strict": True}}},
     "response_format", ResponseFormat("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, "response_format",
     ResponseFormat("json_schema", "{}")),  # OpenAI's schema is optional: any JSON value
    ("chat", {}, "priority", 0),
    ("chat", {"priority": -1000}, "priority", -1000),
    ("completion", {"priority": 1000}, "priority", 1000),
    # Fields that do not change the answer, and the values of refused ones that mean "off".
    ("chat", {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}, "top_k", 0),
    ("chat", {"min_p": 0.0, "echo": False, "modalities": ["text"], "skip_special_tokens": True}, "top_k", 0),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "extra", "attr", "value"), HONOURED)
def test_honoured_parameters_read_as_given(kind, extra, attr, value):
    base = CHAT if kind == "chat" else COMPLETION
    params = parse_request(kind, {**base, **extra}).params
    assert getattr(params, attr) == value


REFUSED = [
    # (kind, extra body, the 400's param)
    ("chat", {"presence_penalty": 9.0}, "presence_penalty"),
    ("chat", {"presence_penalty": -2.5}, "presence_penalty"),
    ("chat", {"presence_penalty": "high"}, "presence_penalty"),
    ("chat", {"frequency_penalty": 2.01}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"repetition_penalty": -1}, "repetition_penalty"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": True}}, "logit_bias"),
    ("chat", {"logit_bias": [5, 1]}, "logit_bias"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
    ("chat", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("chat", {"min_tokens": 1.5}, "min_tokens"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"top_k": 2.5}, "top_k"),
    ("chat", {"top_k": True}, "top_k"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ("completion", {"logprobs": 6}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": "json"}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),  # without tools
    ("chat", {"tools": []}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"}, "tool_choice"),
    ("chat", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("completion", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"audio": {"voice": "alloy"}}, "audio"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"store": True}, "store"),
    ("chat", {"moderation": {"input": {"mode": "block"}}}, "moderation"),
    ("chat", {"service_tier": "priority"}, "service_tier"),
    ("chat", {"min_p": 0.1}, "min_p"),
    ("chat", {"min_p": False}, "min_p"),
    ("chat", {"stop_token_ids": [5]}, "stop_token_ids"),
    ("chat", {"guided_json": SCHEMA}, "guided_json"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"echo": True}, "echo"),
    ("completion", {"suffix": "end"}, "suffix"),
    ("chat", {"priority": 1001}, "priority"),
    ("completion", {"priority": -1001}, "priority"),
    ("chat", {"priority": 1.5}, "priority"),
    ("chat", {"priority": True}, "priority"),
    ("chat", {"priority": "high"}, "priority"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "extra", "param"), REFUSED)
def test_refused_parameters_are_a_400_naming_them(kind, extra, param):
    base = CHAT if kind == "chat" else COMPLETION
    with pytest.raises(APIError) as info:
        parse_request(kind, {**base, **extra})
    assert (info.value.status, info.value.param) == (400, param), info.value.message
