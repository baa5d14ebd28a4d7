"""The key store and `Principal`, without a server: tables of inputs and what they give."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from stoker.control.keys import KeyStore
from stoker.errors import APIError
from stoker.spec.keys import PREFIX, Limits, Principal, hash_key, validate_key_request


async def test_keys_are_random_prefixed_stored_hashed_and_revocable(tmp_path):
    store = KeyStore(tmp_path / "stoker.db", clock=lambda: 1000.0)
    record, key = await store.create("acme", ("tiny",))
    other_record, other = await store.create("acme", ("tiny",))
    assert key.startswith(PREFIX) and len(key) >= len(PREFIX) + 43 and key != other
    assert store.lookup(key) == record and store.lookup(other) == other_record
    assert store.lookup(key + "x") is None and store.lookup("") is None
    rows = sqlite3.connect(tmp_path / "stoker.db").execute("SELECT * FROM api_keys").fetchall()
    assert not any(key in str(row) for row in rows)
    assert hashlib.sha256(key.encode()).hexdigest() in {row[1] for row in rows}

    reopened = KeyStore(tmp_path / "stoker.db")
    assert reopened.lookup(key) == record and len(reopened) == 2
    assert await reopened.revoke(record.id) == record
    assert reopened.lookup(key) is None and len(reopened) == 1
    assert KeyStore(tmp_path / "stoker.db").lookup(key) is None
    with pytest.raises(APIError) as exc:
        await reopened.revoke(record.id)
    assert exc.value.status == 404 and exc.value.code == "key_not_found"


def test_a_principal_calls_its_deployments_and_the_admin_all():
    tenant = Principal(admin=False, tenant="acme", deployments=frozenset({"tiny"}))
    assert tenant.may_call("tiny") and not tenant.may_call("other")
    assert Principal(admin=True).may_call("anything")


@pytest.mark.parametrize(
    "body, param",
    [
        ([], None),
        ({"tenant": "acme"}, "deployments"),
        ({"tenant": "acme", "deployments": []}, "deployments"),
        ({"tenant": "acme", "deployments": "tiny"}, "deployments"),
        ({"tenant": "acme", "deployments": ["Bad Name"]}, "deployments"),
        ({"tenant": "", "deployments": ["tiny"]}, "tenant"),
        ({"tenant": 3, "deployments": ["tiny"]}, "tenant"),
        ({"tenant": "acme", "deployments": ["tiny"], "admin": True}, "admin"),
    ],
)
def test_a_bad_key_request_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as exc:
        validate_key_request(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_a_key_request_keeps_deployments_once_in_order():
    assert validate_key_request({"tenant": "acme", "deployments": ["b", "a", "b"]}) == (
        "acme",
        ("b", "a"),
        Limits(),
    )


async def test_a_key_keeps_its_limits_and_a_store_made_before_limits_opens(tmp_path):
    path = tmp_path / "stoker.db"
    old = sqlite3.connect(path)  # the table as it was before keys had limits
    old.execute(
        "CREATE TABLE api_keys (id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE,"
        " tenant TEXT NOT NULL, deployments TEXT NOT NULL, created_at REAL NOT NULL)"
    )
    old.execute(
        "INSERT INTO api_keys VALUES ('key_old', ?, 'acme', '[\"tiny\"]', 1.0)", (hash_key("sk-old"),)
    )
    old.commit()
    old.close()
    store = KeyStore(path)
    assert store.lookup("sk-old").limits == Limits()
    limits = Limits(rps=2.5, tpm=1000, max_concurrent=3)
    record, key = await store.create("acme", ("tiny",), limits)
    assert KeyStore(path).lookup(key).limits == limits
    assert record.principal.limits == limits and record.principal.key_id == record.id
    assert record.to_dict()["rps"] == 2.5 and record.to_dict()["max_concurrent"] == 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("rps", 0),
        ("rps", -1),
        ("rps", "5"),
        ("rps", True),
        ("rps", float("inf")),
        ("tpm", 0),
        ("tpm", 1.5),
        ("max_concurrent", 0),
        ("max_concurrent", 10**7),
    ],
)
def test_a_bad_limit_is_a_400_naming_it(field, value):
    with pytest.raises(APIError) as exc:
        validate_key_request({"tenant": "acme", "deployments": ["tiny"], field: value})
    assert exc.value.status == 400 and exc.value.param == field
