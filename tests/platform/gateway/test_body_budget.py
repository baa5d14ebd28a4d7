"""The gateway's budget of request-body bytes held at once (`stoker.gateway.body_budget`): what is
taken, refused and given back, read through a real ASGI `receive` of chunks."""

from __future__ import annotations

import pytest

from stoker.errors import APIError
from stoker.gateway.body_budget import BodyBudget, read_body_within
from stoker.http import ClientGone

LIMIT = 100  # the one body limit, for these tests


def receiver(*chunks: bytes, disconnect: bool = False):
    """An ASGI `receive` that hands out `chunks` (the last without more_body), then a disconnect."""
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    if disconnect:
        messages[-1]["more_body"] = True
        messages.append({"type": "http.disconnect"})
    calls = []

    async def receive():
        calls.append(1)
        return messages.pop(0)

    return receive, calls


def scope(length: int | None = None) -> dict:
    headers = [(b"content-length", str(length).encode())] if length is not None else []
    return {"type": "http", "headers": headers}


async def test_a_body_that_fits_is_taken_until_given_back():
    budget = BodyBudget(50)
    receive, _ = receiver(b"x" * 20, b"y" * 10)
    body = await read_body_within(budget, receive, scope(30), LIMIT)
    assert (body, budget.held) == (b"x" * 20 + b"y" * 10, 30)
    budget.give(len(body))
    assert budget.held == 0


async def test_a_declared_length_that_does_not_fit_is_refused_unread():
    budget = BodyBudget(50)
    assert budget.take(30)
    receive, calls = receiver(b"x" * 30)
    with pytest.raises(APIError) as refused:
        await read_body_within(budget, receive, scope(30), LIMIT)
    error = refused.value
    assert (error.status, error.code, error.headers["retry-after"]) == (503, "server_overloaded", "1")
    assert calls == [] and budget.held == 30


@pytest.mark.parametrize(
    ("chunks", "disconnect", "status"),
    [
        ((b"x" * 30, b"y" * 30), False, 503),  # chunked: the second chunk does not fit
        ((b"x" * 30,), True, None),  # the client left mid-body
        ((b"x" * 40, b"y" * 70), False, 413),  # over the body limit
    ],
)
async def test_what_a_failed_read_took_is_given_back(chunks, disconnect, status):
    budget = BodyBudget(50)
    receive, _ = receiver(*chunks, disconnect=disconnect)
    with pytest.raises(ClientGone if status is None else APIError) as failed:
        await read_body_within(budget, receive, scope(), LIMIT)
    assert getattr(failed.value, "status", None) == status
    assert budget.held == 0


async def test_a_declared_length_that_is_never_sent_holds_nothing():
    budget = BodyBudget(50)
    receive, _ = receiver(b"", disconnect=True)
    with pytest.raises(ClientGone):
        await read_body_within(budget, receive, scope(40), LIMIT)
    assert budget.held == 0


def test_a_budget_is_a_positive_number_of_bytes():
    for bad in (0, -1, 1.5, True, "256MiB"):
        with pytest.raises(ValueError, match="positive number of bytes"):
            BodyBudget(bad)
