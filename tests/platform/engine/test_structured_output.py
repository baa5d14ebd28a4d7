"""`response_format` on a real engine: answers that parse and validate against their schema (the
official client's `parse`, streams, json_object), constrained requests batched with free ones, and
schemas that cannot be enforced refused with a 400 on `response_format`."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.deadlines import deadline

CHAT = [{"role": "user", "content": "Describe a city as JSON."}]


class City(BaseModel):
    name: Literal["Paris", "Lyon", "Nice"]
    population: int = Field(ge=0, le=99)
    capital: bool
    motto: str = Field(max_length=6)


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_official_clients_parse_gets_a_valid_object(client, seed):
    r = client.chat.completions.parse(
        model="tiny", messages=CHAT, response_format=City, max_tokens=400, temperature=1.0, seed=seed
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)  # pydantic validated every bound
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


def test_a_streamed_json_schema_answer_parses_and_validates(client):
    chunks = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        response_format=FORMAT,
        max_tokens=400,
        temperature=1.0,
        seed=4,
        stream=True,
    )
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_a_response_format_too(client):
    r = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=400,
        temperature=1.0,
        seed=5,
        extra_body={"response_format": FORMAT},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_json_object_is_an_object_and_ends_there(client, tiny_snapshot):
    from transformers import AutoTokenizer

    (close,) = AutoTokenizer.from_pretrained(tiny_snapshot).encode("}")
    # A random model rarely closes what it opens: a bias on "}" shows the grammar's end (EOS alone
    # is allowed after the object) and that logit_bias composes with the mask.
    r = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        response_format={"type": "json_object"},
        logit_bias={str(close): 20},
        max_tokens=50,
        temperature=0,
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("{}", "stop")
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, response_format={"type": "json_object"}, max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content.lstrip().startswith("{")


async def test_constrained_and_free_requests_share_a_batch_without_leaking(engine):
    """Four at once (one forward step serves them all): each constrained one valid, each free one
    exactly what it is alone."""
    free_body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    fmt_body = {"model": "tiny", "prompt": "JSON:", "max_tokens": 400, "temperature": 1.0,
                "response_format": FORMAT}  # fmt: skip
    async with httpx.AsyncClient(base_url=engine.url, timeout=deadline(120)) as http:

        async def text(body: dict, seed: int | None = None) -> dict:
            r = await http.post("/v1/completions", json={**body, "seed": seed} if seed else body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        alone = await text(free_body)
        together = await asyncio.gather(
            text(fmt_body, 11), text(free_body), text(fmt_body, 12), text(free_body)
        )
    for choice in together[0::2]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    assert [c["text"] for c in together[1::2]] == [alone["text"]] * 2


BAD_SCHEMAS = [
    {"type": "nonsense"},  # not JSON Schema
    {"not": {"type": "string"}},  # a keyword llguidance cannot enforce: refused, not loosened
    {"type": "string", "format": "no-such-format"},
    {"type": "integer", "minimum": 5, "maximum": 2},  # nothing can satisfy it
    {"type": "string", "pattern": "[unclosed"},
    {"$ref": "http://example.com/schema.json"},  # nothing is fetched
    {"$ref": "#"},  # itself all the way down: no finite value (was a 200 with empty content)
]


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=range(len(BAD_SCHEMAS)))
def test_a_schema_that_cannot_be_enforced_is_a_400_on_response_format(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, response_format=fmt, max_tokens=4)
    assert info.value.body["param"] == "response_format"
    ok = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_whitespace_is_bounded_so_a_model_that_loves_it_still_ends(client, tiny_snapshot):
    """A model whose favourite token is whitespace (here: +100 on each whitespace-only token) still
    closes its object: at most 32 whitespace characters go between two JSON tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_snapshot)
    spaces = [i for i in range(len(tok)) if tok.decode([i]).isspace()]
    r = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        response_format=FORMAT,
        logit_bias={str(i): 100 for i in spaces},
        max_tokens=1000,
        temperature=0,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert max(len(run) for run in re.findall(r"\s+", text)) == 32
