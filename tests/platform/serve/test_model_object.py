"""The gateway's `GET /v1/models/{model}`: OpenAI's model object for a deployment the caller's key
may call, and for another tenant's the same 404 as for one that does not exist."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

ADMIN = "admin-secret-for-tests"


def test_a_model_object_for_the_callers_deployments_only(platform_factory, tiny_model_dir):
    p = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN})
    p.deploy("tiny", tiny_model_dir)  # no request: no instance is started for this test
    p.deploy("other", tiny_model_dir)
    made = json.loads(p.cli("keys", "create", "--tenant", "acme", "--deployment", "tiny", "--json").stdout)

    tenant = openai.OpenAI(base_url=f"{p.url}/v1", api_key=made["key"], max_retries=0)
    model = tenant.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "stoker")
    answers = []
    for name in ("other", "missing"):
        with pytest.raises(openai.NotFoundError) as info:
            tenant.models.retrieve(name)
        answers.append(info.value.body)
    other, missing = answers
    assert other["code"] == missing["code"] == "model_not_found"
    assert other["message"].replace("other", "X") == missing["message"].replace("missing", "X")

    admin = openai.OpenAI(base_url=f"{p.url}/v1", api_key=ADMIN, max_retries=0)
    assert admin.models.retrieve("other").id == "other"
    assert httpx.get(f"{p.url}/v1/models/tiny").status_code == 401  # no key
