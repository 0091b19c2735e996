"""A JSON string (value or key) holding a lone UTF-16 surrogate is a 400 naming the field,
before anything is stored, on every route (contract §14). Python's JSON parser lets one
through and PostgreSQL's `json` column stores it; every answer that includes it then fails
to encode: a consumer registered with one answered 500 once committed, and its owner's
list answered 500 from then on."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from sqlalchemy import func, select

from queuekeeper.common.input_guard import reject_unstorable_input
from queuekeeper.events.endpoints import accept_router
from queuekeeper.models import Event, EventConsumer
from tests.consumers.scopes import scopes, staff
from tests.events.support import order_event
from tests.helpers import Backend

CONSUMERS = "/api/event-consumers/"
JSON = {"content-type": "application/json"}


def escaped(body: object) -> bytes:
    """`body` as JSON text with every non-ASCII character escaped: a lone surrogate as
    `\\udXXX`, which is what a client (or an attacker) sends."""
    return json.dumps(body).encode()


async def _count(app: FastAPI, model: type[Any]) -> int:
    async with app.state.queuekeeper.sessions() as session:
        found: int = await session.scalar(select(func.count()).select_from(model))
        return found


def _fields(answer: httpx.Response) -> list[str]:
    return [error["field"] for error in answer.json()["errors"]]


async def test_a_lone_surrogate_in_payload_filters_is_a_400_and_no_consumer_is_made(
    app: FastAPI, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    binding = scopes(("offering", offering))
    for body, field in [
        ({"scopes": binding, "payload_filters": {"k": ["\ud800"]}}, "payload_filters.k.0"),
        ({"scopes": binding, "payload_filters": {"k\udc00": ["x"]}}, "payload_filters.k\\udc00"),
        ({"scopes": binding, "payload_filters": {"k": [{"deep": ["\udbff"]}]}}, None),
    ]:
        answer = await agent.client.post(
            f"{CONSUMERS}register/", content=escaped(body), headers={**agent.headers, **JSON}
        )
        assert answer.status_code == 400, answer.text
        assert "surrogate" in answer.json()["detail"]
        assert _fields(answer) == [field or "payload_filters.k.0.deep.0"]
    assert await _count(app, EventConsumer) == 0
    # The owner's list still answers (it once answered 500 for good).
    listed = await agent.client.get(CONSUMERS, headers=agent.headers)
    assert (listed.status_code, listed.json()) == (200, [])


async def test_a_surrogate_as_utf8_bytes_or_without_a_content_type_is_a_400(
    app: FastAPI, backend: Backend
) -> None:
    """`json.loads` decodes bytes with "surrogatepass", so a surrogate's bytes in UTF-8 (or
    a body in UTF-16) reach the parsed body as an escape does; a body without a Content-Type
    is refused as not JSON."""
    agent, offering = await backend.agent_with_offering()
    body = {"scopes": scopes(("offering", offering)), "payload_filters": {"k": ["@"]}}
    as_bytes = escaped(body).replace(b"@", "\ud800".encode("utf-8", "surrogatepass"))
    as_utf16 = escaped(body).decode().replace("@", "\ud800").encode("utf-16", "surrogatepass")
    for content in [as_bytes, as_utf16]:
        answer = await agent.client.post(
            f"{CONSUMERS}register/", content=content, headers={**agent.headers, **JSON}
        )
        assert (answer.status_code, _fields(answer)) == (400, ["payload_filters.k.0"]), answer.text
    untyped = escaped({**body, "payload_filters": {"k": ["\ud800"]}})
    answer = await agent.client.post(
        f"{CONSUMERS}register/", content=untyped, headers=agent.headers
    )
    assert answer.status_code == 400, answer.text
    assert await _count(app, EventConsumer) == 0


async def test_a_lone_surrogate_through_register_webhook_is_a_400_naming_it(
    app: FastAPI, backend: Backend
) -> None:
    admin = await staff(backend)
    for body, field in [
        ({"webhook_url": "https://hooks.example.org/\ud800"}, "webhook_url"),
        (
            {"webhook_url": "https://hooks.example.org/", "payload_filters": {"k": ["\udfff"]}},
            "payload_filters.k.0",
        ),
    ]:
        answer = await admin.client.post(
            f"{CONSUMERS}register_webhook/",
            content=escaped(body),
            headers={**admin.headers, **JSON},
        )
        assert (answer.status_code, _fields(answer)) == (400, [field]), answer.text
    assert await _count(app, EventConsumer) == 0


async def test_a_lone_surrogate_in_an_event_is_a_400_on_the_lean_and_the_fastapi_path(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    _agent, offering = await backend.agent_with_offering()
    event = order_event(offering, payload={"order_uuid": uuid.uuid4().hex, "note": "\ud800"})
    for path, body, field, headers in [
        ("/api/internal/events/", event, "payload.note", JSON),  # the lean path
        ("/api/internal/events/batch/", {"events": [event]}, "events.0.payload.note", JSON),
        # FastAPI's path: the lean one leaves a query it is not sure of to it.
        ("/api/internal/events/?wait=0", event, "payload.note", JSON),
    ]:
        answer = await client.post(
            path, content=escaped(body), headers={**backend.headers, **headers}
        )
        assert (answer.status_code, _fields(answer)) == (400, [field]), answer.text
    assert await _count(app, Event) == 0


def test_every_route_checks_its_input_before_its_endpoint_runs(app: FastAPI) -> None:
    """The check is one dependency on every route; the accept routes, which run none, call
    it themselves (events/endpoints.py, tested above)."""
    lean = {
        path
        for route in accept_router.routes
        for path in (route.path, f"{accept_router.prefix}{route.path}")
    }  # type: ignore[attr-defined]
    checked, unchecked = 0, []
    for route in iter_route_contexts(app.routes):
        dependant = getattr(route, "dependant", None)
        if dependant is None or not route.include_in_schema:
            continue
        if reject_unstorable_input in [d.call for d in dependant.dependencies]:
            checked += 1
        elif route.path not in lean:
            unchecked.append(route.path)
    assert checked > 40  # every route was seen
    assert unchecked == []


@pytest.mark.parametrize("depth", [150, 5000])
async def test_a_body_nested_too_deeply_is_a_400_on_every_path(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient, depth: int
) -> None:
    """Past the parser's recursion (5000) or only past what the rest can take (150): the
    lean accept path once answered 500 for the first."""
    agent, offering = await backend.agent_with_offering()
    deep = b"[" * depth + b"1" + b"]" * depth
    binding = escaped(scopes(("offering", offering)))
    register = b'{"scopes": %s, "payload_filters": {"k": [%s]}}' % (binding, deep)
    answer = await agent.client.post(
        f"{CONSUMERS}register/", content=register, headers={**agent.headers, **JSON}
    )
    assert answer.status_code == 400, answer.text
    event = b'{"offering_uuid": "%s", "object_type": "order", "payload": {"x": %s}}' % (
        offering.hex.encode(),
        deep,
    )
    for path in ["/api/internal/events/", "/api/internal/events/?wait=0"]:
        answer = await client.post(path, content=event, headers={**backend.headers, **JSON})
        assert answer.status_code == 400, answer.text
        if depth < 1000:  # parsed: the field is named
            assert _fields(answer)[0].startswith("payload.x.0.0"), answer.text
            assert "nested deeper than 100 levels" in answer.json()["detail"]
    assert await _count(app, EventConsumer) == 0
    assert await _count(app, Event) == 0
