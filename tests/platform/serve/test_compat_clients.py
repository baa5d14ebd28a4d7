"""Clients nobody here wrote, against a real `stoker up` serving the tiny model on the CPU engine: the
official `openai` client, LiteLLM and LangChain's `ChatOpenAI` (all three in the dev extra), and
`promtool check metrics` on what the gateway exports (where `make test` could fetch promtool).

Each client does what its users do: plain and streamed chat, a completion, structured output into
a pydantic model, logprobs, and the errors it maps to its own exception classes. The model is random
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
from pydantic import BaseModel

from tests.conftest import promtool
from tests.deadlines import CLI, ENGINE_START
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
