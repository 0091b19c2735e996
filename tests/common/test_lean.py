"""The accept routes' lean path (common/lean.py) answers every request as FastAPI's route
does: the same status, body and headers, whichever path served it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from queuekeeper.common import lean
from queuekeeper.common.lean import LeanEndpoint
from tests.events.support import SERVICE, order_event, register
from tests.helpers import Backend

pytestmark = pytest.mark.settings(relay_enabled=False, presence_events_enabled=False)

STRANGER = uuid.UUID("0badc0de0badc0de0badc0de0badc0de")  # an offering never pushed


def _cases(offering: uuid.UUID, tag: str) -> list[tuple[str, str, str, Any]]:
    """(name, path and query, content type, body: a JSON value or raw bytes)."""
    one = "/api/internal/events/"
    batch = "/api/internal/events/batch/"
    event = order_event(offering, event_id=f"{tag}-1")
    bare = {k: v for k, v in order_event(offering).items() if k != "object_type"}
    return [
        ("a new event", one, "application/json", event),
        ("the same event again: a duplicate", one, "application/json", event),
        ("with charset", one, "application/json; charset=utf-8", order_event(offering)),
        ("wait=false", one + "?wait=false", "application/json", order_event(offering)),
        ("wait=no (FastAPI's bool)", one + "?wait=no", "application/json", order_event(offering)),
        ("wait=maybe", one + "?wait=maybe", "application/json", order_event(offering)),
        ("an unknown query parameter", one + "?x=1", "application/json", order_event(offering)),
        ("no object_type", one, "application/json", bare),
        ("malformed JSON", one, "application/json", b'{"offering_uuid": '),
        ("a JSON list", one, "application/json", [1]),
        ("another content type", one, "text/plain", order_event(offering)),
        ("an unknown offering", one, "application/json", order_event(STRANGER)),
        (
            "a payload missing its required field",
            one,
            "application/json",
            {**order_event(offering), "payload": {"order_state": "done"}},
        ),
        (
            "NaN in the payload",
            one,
            "application/json",
            b'{"offering_uuid": "%s", "object_type": "order", '
            b'"payload": {"order_uuid": "%s", "x": NaN}}'
            % (offering.hex.encode(), uuid.uuid4().hex.encode()),
        ),
        (
            "a NUL character",
            one,
            "application/json",
            {**order_event(offering), "payload": {"order_uuid": uuid.uuid4().hex, "x": "a\u0000"}},
        ),
        ("a batch", batch, "application/json", {"events": [order_event(offering)] * 2}),
        (
            "a batch with a bad event",
            batch,
            "application/json",
            {"events": [order_event(offering), bare]},
        ),
        ("a batch that is no object", batch, "application/json", {"events": 3}),
    ]


def _shape(response: httpx.Response, tag: str, ids: Callable[[str], str]) -> Any:
    """Status, the headers a caller reads, and the body with generated ids made stable."""
    text = response.text.replace(tag, "TAG")
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    if isinstance(body, dict):
        for answer in body.get("events", [body]):
            if isinstance(answer, dict) and "event_id" in answer:
                answer["event_id"] = ids(answer["event_id"])
    headers = {k: v for k, v in response.headers.items() if k not in ("x-request-id", "date")}
    return response.status_code, headers, body


async def _answers(client: httpx.AsyncClient, offering: uuid.UUID, tag: str) -> dict[str, Any]:
    seen: dict[str, str] = {}

    def stable(event_id: str) -> str:
        return event_id if event_id.startswith("TAG") else seen.setdefault(event_id, "generated")

    answers = {}
    for name, path, content_type, body in _cases(offering, tag):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**SERVICE, "Content-Type": content_type}
        response = await client.post(path, content=raw, headers=headers)
        answers[name] = _shape(response, tag, stable)
    return answers


async def test_every_accept_answer_is_the_same_on_the_lean_path_and_fastapis(
    client: httpx.AsyncClient, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered = await register(backend)
    served: list[str] = []
    serve = lean.serve

    async def counted(
        endpoint: LeanEndpoint, route: Any, app: ASGIApp, scope: Scope, r: Receive, s: Send
    ) -> None:
        served.append(scope["path"])
        await serve(endpoint, route, app, scope, r, s)

    monkeypatch.setattr(lean, "serve", counted)
    on_lean = await _answers(client, registered.offering, "zqa")
    # Every accept request went through the lean path (and what it left to FastAPI, too).
    assert len(served) == len(_cases(registered.offering, "x"))

    async def fastapi_only(
        _endpoint: LeanEndpoint, _route: Any, app: ASGIApp, scope: Scope, r: Receive, s: Send
    ) -> None:
        await app(scope, r, s)

    monkeypatch.setattr(lean, "serve", fastapi_only)
    on_fastapi = await _answers(client, registered.offering, "zqb")
    assert on_lean.keys() == on_fastapi.keys()
    for name in on_lean:
        assert on_lean[name] == on_fastapi[name], name
    # The cases do what they say: stored, a duplicate, refusals naming the field.
    assert on_lean["a new event"][0] == 202
    assert on_lean["the same event again: a duplicate"][0] == 200
    assert on_lean["an unknown offering"][0] == 400
    assert on_lean["malformed JSON"][0] == 400
    assert on_lean["a batch"][0] == 202
