"""A datetime without an offset is UTC, the same everywhere one is accepted (contract §14),
and one that falls outside years 1-9999 in UTC is a 400 naming its field, before anything
is written. A naive role expiry once answered 500 after its commit (a naive value compared
with the clock), so the copies the expired role no longer allowed stayed in the queue."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from pydantic import TypeAdapter
from sqlalchemy import func, select

from queuekeeper.common import schemas
from queuekeeper.config import Settings
from queuekeeper.models import Role, User, utcnow
from tests.consumers.scopes import put, role, scopes, tree
from tests.consumers.sweeps import swept
from tests.consumers.test_revoked_role_copies import read_all, sent
from tests.consumers.test_scoped_delivery import consumer_of
from tests.events.support import order_event
from tests.helpers import Agent, Backend

NAIVE = "2030-01-02T03:04:05"
AS_UTC = "2030-01-02T03:04:05Z"
# In UTC: before year 1 and after year 9999.
OUT_OF_RANGE = ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"]


def _role_body(agent: Agent, customer: uuid.UUID, expires_at: str) -> dict[str, Any]:
    return {
        "user_uuid": agent.uuid.hex,
        "role_name": "customer.member",
        "scope": {"type": "customer", "uuid": customer.hex},
        "expires_at": expires_at,
    }


async def test_a_role_expired_by_a_naive_datetime_takes_its_copies_out_of_the_queue(
    backend: Backend, client: httpx.AsyncClient, settings: Settings
) -> None:
    entities = await tree(client)
    watcher = await backend.put_user()
    granted = await role(client, watcher, "customer", entities.customer)
    mine = await consumer_of(watcher, {"scopes": scopes(("customer", entities.customer))})
    for _ in range(2):
        await sent(client, order_event(entities.offering))
    past = (utcnow() - timedelta(minutes=5)).replace(tzinfo=None).isoformat()
    answer = await put(client, f"/roles/{granted}/", _role_body(watcher, entities.customer, past))
    assert answer.status_code == 200, answer.text
    stored = datetime.fromisoformat(answer.json()["expires_at"])
    assert stored == datetime.fromisoformat(past).replace(tzinfo=UTC)
    await swept(settings)
    assert await read_all(watcher, mine, 0) == []


async def test_a_datetime_without_an_offset_is_utc_in_every_body(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent = await backend.put_user()
    user = await put(client, f"/users/{agent.uuid}/", {"username": "u", "token_expires_at": NAIVE})
    assert (user.status_code, user.json()["token_expires_at"]) == (200, AS_UTC), user.text
    customer = uuid.uuid4()
    await put(client, f"/customers/{customer}/", {"name": "C"})
    made = await put(client, f"/roles/{uuid.uuid4()}/", _role_body(agent, customer, NAIVE))
    assert (made.status_code, made.json()["expires_at"]) == (201, AS_UTC), made.text


@pytest.mark.parametrize("value", OUT_OF_RANGE)
async def test_a_datetime_out_of_range_in_utc_is_a_400_naming_it_and_nothing_is_written(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient, value: str
) -> None:
    agent, offering = await backend.agent_with_offering()
    customer = uuid.uuid4()
    await put(client, f"/customers/{customer}/", {"name": "C"})
    role_uuid = uuid.uuid4()
    consumer = await consumer_of(agent, {"scopes": scopes(("offering", offering))})
    cases: list[tuple[str, str, dict[str, str], dict[str, Any], str]] = [
        (
            "PUT",
            f"/api/internal/users/{uuid.uuid4()}/",
            backend.headers,
            {"username": "x", "token_expires_at": value},
            "token_expires_at",
        ),
        (
            "PUT",
            f"/api/internal/roles/{role_uuid}/",
            backend.headers,
            _role_body(agent, customer, value),
            "expires_at",
        ),
        (
            "POST",
            f"/api/event-consumers/{consumer['rmq_username']}/replay/",
            agent.headers,
            {"since": value},
            "since",
        ),
        (
            "POST",
            f"/api/event-consumers/{consumer['rmq_username']}/replay/",
            agent.headers,
            {"since": (utcnow() - timedelta(minutes=1)).isoformat(), "until": value},
            "until",
        ),
    ]
    sessions = app.state.queuekeeper.sessions

    async def rows() -> tuple[int, int]:
        async with sessions() as session:
            users = await session.scalar(select(func.count()).select_from(User))
            roles = await session.scalar(select(func.count()).select_from(Role))
            return users, roles

    before = await rows()
    for method, path, headers, body, field in cases:
        answer = await client.request(method, path, json=body, headers=headers)
        assert answer.status_code == 400, (path, answer.text)
        assert [error["field"] for error in answer.json()["errors"]] == [field], answer.text
        assert "out of range" in answer.json()["errors"][0]["message"]
    assert await rows() == before


def _unguarded_datetimes(node: Any, parent: Any = None) -> int:
    """How many datetimes in a pydantic core schema are not InputDateTime's."""
    found = 0
    if isinstance(node, dict):
        if node.get("type") == "datetime":
            guarded = isinstance(parent, dict) and parent.get("type") == "function-after"
            function = (parent or {}).get("function", {}).get("function")
            found += 0 if guarded and function is schemas._storable else 1
        for value in node.values():
            found += _unguarded_datetimes(value, node)
    elif isinstance(node, list):
        for value in node:
            found += _unguarded_datetimes(value, parent)
    return found


def test_every_datetime_a_request_takes_is_read_as_utc(app: FastAPI) -> None:
    """Every body field and query parameter that is a datetime goes through InputDateTime
    (common/schemas.py), so a new one cannot take a naive value as it is."""
    unguarded, bodies = [], 0
    for route in iter_route_contexts(app.routes):
        dependant = getattr(route, "dependant", None)
        if dependant is None:
            continue
        fields = list(dependant.query_params)
        if route.body_field is not None:
            fields.append(route.body_field)
            bodies += 1
        for field in fields:
            info = field.field_info
            annotation = (
                Annotated[(info.annotation, *info.metadata)]  # type: ignore[valid-type]
                if info.metadata
                else info.annotation
            )
            if _unguarded_datetimes(TypeAdapter(annotation).core_schema):
                unguarded.append(f"{route.path} {field.name}")
    assert bodies > 15  # every route was seen
    assert unguarded == []
