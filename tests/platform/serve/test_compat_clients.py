"""Clients nobody here wrote, against a real `stoker up` serving the tiny model on the CPU engine: the
official `openai` client, LiteLLM and LangChain's `ChatOpenAI` and `OpenAIEmbeddings` (all in the
dev extra), and `promtool check metrics` on what the gateway exports (where `make test` could fetch
promtool).

Each client does what its users do: plain and streamed chat, a completion, n choices, structured
output into a pydantic model, logprobs, tool calls (the openai client's `tools=`, LangChain's
`bind_tools`), the Responses API (whole, parsed and streamed), embeddings from an embedding
deployment (`--task embed`, a
tiny BERT encoder), and the errors it maps to its own exception classes. The model is random
weights, so the checks are on shapes and contracts, never on what the text says.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.conftest import build_tiny_encoder, promtool
from tests.deadlines import CLI, ENGINE_START, WAIT
from tests.platform.gateway.test_keys import ADMIN

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list otherwise

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class City(BaseModel):
    """Every field bounded, so even random weights finish the object within `max_tokens` (the
    grammar allows at most 32 characters of whitespace between tokens)."""

    name: Literal["Paris", "Lyon", "Nice"]
    capital: bool


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_model_dir):
    from tests.platform.conftest import PlatformProcess
    from tests.platform.engine.conftest import free_port

    home = tmp_path_factory.mktemp("compat") / "home"
    p = PlatformProcess(home, free_port(), (), extra_env={"STOKER_ADMIN_KEY": ADMIN}).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "10m")
        p.wait_for(
            lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "a READY instance"
        )
        made = p.cli("keys", "create", "--tenant", "compat", "--deployment", "tiny", "--json").stdout
        p.tenant_key = json.loads(made)["key"]
        encoder = build_tiny_encoder(tmp_path_factory.mktemp("encoder") / "tiny-bert")
        p.deploy("emb", encoder, "--task", "embed", "--max", "1", "--idle-timeout", "10m")
        made = p.cli("keys", "create", "--tenant", "search", "--deployment", "emb", "--json").stdout
        p.embed_key = json.loads(made)["key"]
        p.tiny_model_dir = tiny_model_dir
        yield p
    finally:
        p.stop()


def test_openai_client(platform):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.tenant_key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    chat = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    text = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=2)
    three = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=4, n=3, temperature=1.0
    )
    assert [c.index for c in three.choices] == [
        0,
        1,
        2,
    ] and three.usage.prompt_tokens == chat.usage.prompt_tokens
    assert len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens

    with_logprobs = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = with_logprobs.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)

    parsed = client.chat.completions.parse(
        model="tiny", messages=QUESTION, response_format=City, max_tokens=400, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, City)

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=QUESTION, presence_penalty=9.0)
    assert bad.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{platform.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_openai_client_responses(platform):
    """`responses.create`, `responses.parse` and `responses.stream` through the gateway, each
    Response's usage metered as its deployment's tokens in and out."""
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.tenant_key, max_retries=0)

    def tokens() -> tuple[int, int]:
        rows = {r["deployment"]: r for r in platform.admin_get("/admin/v1/cost")["data"]}
        return rows["tiny"]["tokens_in"], rows["tiny"]["tokens_out"]

    before = tokens()
    answer = client.responses.create(
        model="tiny",
        instructions="Answer briefly.",
        input="What is the capital of France?",
        max_output_tokens=8,
    )
    assert answer.id.startswith("resp_") and answer.output[0].type == "message"
    assert isinstance(answer.output_text, str) and answer.usage.output_tokens >= 1
    parsed = client.responses.parse(
        model="tiny", input="Name a city.", text_format=City, max_output_tokens=400, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)
    with client.responses.stream(
        model="tiny", input="Name a city.", text_format=City, max_output_tokens=400, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == parsed.output_text
    assert streamed.output_parsed == parsed.output_parsed
    weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
               "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "name": "get_weather", "parameters": weather, "strict": True}]
    called = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=300, temperature=0,
    )  # fmt: skip
    [call] = called.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="Hi", store=True)
    assert refused.value.body["param"] == "store"
    answers = (answer, parsed, streamed, called)
    used = (sum(a.usage.input_tokens for a in answers), sum(a.usage.output_tokens for a in answers))
    # The meter counts a request once its answer went out: waited for, bounded, never slept on.
    expected = (before[0] + used[0], before[1] + used[1])
    platform.wait_for(lambda: tokens() == expected, WAIT, f"tokens {expected} metered")


def test_litellm(platform):
    import litellm

    common = {"model": "openai/tiny", "api_base": f"{platform.url}/v1", "api_key": platform.tenant_key}
    answer = litellm.completion(messages=QUESTION, max_tokens=8, **common)
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens >= 1
    streamed = list(litellm.completion(messages=QUESTION, max_tokens=8, stream=True, **common))
    assert streamed and streamed[-1].choices[0].finish_reason in ("stop", "length")
    text = litellm.text_completion(prompt="Hello", max_tokens=4, **common)
    assert text.choices[0].text is not None
    with pytest.raises(litellm.exceptions.BadRequestError):
        litellm.completion(messages=QUESTION, max_tokens=8, frequency_penalty=5.0, **common)
    with pytest.raises(litellm.exceptions.NotFoundError):
        litellm.completion(messages=QUESTION, **{**common, "model": "openai/nope"})


def test_langchain_chat_openai(platform):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="tiny", base_url=f"{platform.url}/v1", api_key=platform.tenant_key, max_tokens=8, max_retries=0
    )
    reply = llm.invoke([HumanMessage("What is the capital of France?")])
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] >= 1
    pieces = list(llm.stream("Hello"))
    whole = sum(pieces[1:], pieces[0])  # LangChain's own way to put a stream back together
    assert whole.response_metadata["finish_reason"] in ("stop", "length") and len(pieces) > 2
    # with_structured_output was refused before (400 on response_format): it now gets JSON back.
    structured = ChatOpenAI(
        model="tiny", base_url=f"{platform.url}/v1", api_key=platform.tenant_key, max_tokens=400,
        temperature=0, max_retries=0,
    ).with_structured_output(City, method="json_schema")  # fmt: skip
    assert isinstance(structured.invoke("Name a city."), City)


class GetWeather(BaseModel):
    """The weather in a city. No other fields (`additionalProperties: false`, as OpenAI's strict
    mode asks), or random weights could add keys until `max_tokens`."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Lyon", "Nice"]
    celsius: bool


WEATHER = {
    "type": "function",
    "function": {"name": "GetWeather", "parameters": GetWeather.model_json_schema()},
}


def test_tool_calls_from_the_openai_client_and_langchain(platform):
    """A call (named or required, so that random weights must make one), its arguments valid against
    the schema, streamed as deltas that add up, and its result sent back for the next answer."""
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.tenant_key, max_retries=0)
    answer = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=400,
        seed=3,
        parallel_tool_calls=False,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather" and call.id
    GetWeather.model_validate_json(call.function.arguments)

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=[WEATHER], stream=True, max_tokens=400, seed=3,
            tool_choice={"type": "function", "function": {"name": "GetWeather"}}, parallel_tool_calls=False,
        )
    )  # fmt: skip
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert {d.index for d in deltas} == {0} and deltas[0].id and deltas[0].function.name == "GetWeather"
    GetWeather.model_validate_json("".join(d.function.arguments or "" for d in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    after = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert after.choices[0].message.tool_calls is None and after.choices[0].finish_reason in (
        "stop",
        "length",
    )

    llm = ChatOpenAI(
        model="tiny",
        base_url=f"{platform.url}/v1",
        api_key=platform.tenant_key,
        max_tokens=200,
        max_retries=0,
    ).bind_tools([GetWeather], tool_choice="GetWeather")
    reply = llm.invoke("What is the weather in Paris?")
    assert isinstance(reply, AIMessage) and reply.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(reply.tool_calls[0]["args"])


def test_embeddings_from_the_openai_client_litellm_and_langchain(platform):
    import litellm
    from langchain_openai import OpenAIEmbeddings

    texts = ["the quick brown fox", "hello there"]
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.embed_key, max_retries=0)
    got = client.embeddings.create(model="emb", input=texts)  # held while "emb" starts from zero
    assert [d.index for d in got.data] == [0, 1] and len(got.data[0].embedding) == 32
    assert got.usage.prompt_tokens > 0
    common = {"api_base": f"{platform.url}/v1", "api_key": platform.embed_key}
    answer = litellm.embedding(model="openai/emb", input=texts, **common)
    assert len(answer.data) == 2 and answer.data[0]["embedding"] == pytest.approx(
        got.data[0].embedding, abs=1e-5
    )
    lc = OpenAIEmbeddings(
        model="emb", base_url=f"{platform.url}/v1", api_key=platform.embed_key, max_retries=0,
        check_embedding_ctx_length=False,  # it would tokenize with tiktoken's files: sends the text instead
    )  # fmt: skip
    assert lc.embed_query(texts[0]) == pytest.approx(got.data[0].embedding, abs=1e-5)
    assert len(lc.embed_documents(texts)) == 2
    # The key is for "emb" only, and "emb" generates nothing: each refused as OpenAI refuses.
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="tiny", input="x")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="emb", messages=QUESTION)
    assert bad.value.body["code"] == "model_not_generative"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="emb", input="x")
    assert bad.value.body["code"] == "model_not_generative"
    # LoRA adapters need a base that generates.
    from tests.conftest import build_tiny_adapter

    lora = platform.home.parent / "lora"
    build_tiny_adapter(platform.tiny_model_dir, lora, seed=1)
    r = httpx.post(
        f"{platform.url}/admin/v1/deployments",
        json={"name": "a1", "adapter": str(lora), "base": "emb"},
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=CLI,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_engine", r.text
    long = httpx.post(  # a path the filesystem cannot look up: a 400 naming it, not a 500
        f"{platform.url}/admin/v1/deployments",
        json={"name": "a2", "model": "x" * 5000},
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=CLI,
    )
    assert long.status_code == 400 and long.json()["error"]["param"] == "model", long.text
    rows = {r["deployment"]: r for r in json.loads(platform.cli("cost", "--json").stdout)}
    assert rows["emb"]["requests"] >= 4 and rows["emb"]["tokens_in"] > 0 and rows["emb"]["tokens_out"] == 0


@pytest.mark.skipif(
    promtool() is None and not os.environ.get("CI"),  # in CI `make test` fetches it: there it must run
    reason="promtool not found (make test fetches Debian's)",
)
def test_promtool_accepts_the_gateways_metrics(platform):
    assert promtool(), "promtool not found: `make test` fetches Debian's into .tools/"
    admin = {"authorization": f"Bearer {ADMIN}"}
    gateway = httpx.get(f"{platform.url}/metrics", headers=admin).content
    check = subprocess.run([promtool(), "check", "metrics"], input=gateway, capture_output=True, timeout=CLI)
    assert check.returncode == 0, (check.stdout + check.stderr).decode()
    engines = httpx.get(f"{platform.url}/metrics/engines", headers=admin).content
    assert b"vllm:num_requests_running" in engines
    check = subprocess.run([promtool(), "check", "metrics"], input=engines, capture_output=True, timeout=CLI)
    # vLLM's names hold ':', which promtool's lint flags (it does so for vLLM's own server too).
    problems = [
        line
        for line in (check.stdout + check.stderr).decode().splitlines()
        if "should not contain ':'" not in line
    ]
    assert problems == [], problems
