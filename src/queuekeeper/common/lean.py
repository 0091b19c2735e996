"""The backend's two accept routes on a lean path, tried before FastAPI's.

A single event at the backend's pace is dominated by the HTTP stack: FastAPI's routing,
request object, dependency solving and body handling cost more CPU per request than the
event's store (docs/decisions/017-single-event-cost.md). The request guard (auth/guard.py)
has already authenticated the call and bounded its body when it hands a route that declares
a lean endpoint (`access.intake(..., lean=...)`) to `serve`: the body is read here once,
and the lean endpoint parses it with the same model FastAPI would use.

The lean path serves only what it is sure of: a JSON body its model takes and the query
it knows. Anything else (a body the model refuses, an unexpected query parameter or content
type) goes to FastAPI with the body replayed, so every refusal is FastAPI's own answer,
word for word. An exception raised by the lean endpoint is answered by the app's own
exception handlers (the same 4xx/503 as on the FastAPI path).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (scope, body) -> the answer, or None to let FastAPI serve the request.
LeanEndpoint = Callable[[Scope, bytes], Awaitable[Response | None]]
M = TypeVar("M", bound=BaseModel)
_FLAGS = {b"true": True, b"false": False}


async def serve(
    endpoint: LeanEndpoint,
    route: BaseRoute,
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    body = await _read(receive)
    if body is None:
        return  # the client went away before it sent its body: nothing to answer
    scope["route"] = route  # as FastAPI's router sets it: the metrics and the access line
    try:
        response = await endpoint(scope, body)
    except Exception as exc:
        handler = _handler(scope["app"], exc)
        if handler is None:
            raise
        answered = handler(Request(scope), exc)
        response = await answered if inspect.isawaitable(answered) else answered
    if response is None:
        await app(scope, _replayed(body, receive), send)
        return
    await response(scope, receive, send)


def flag(scope: Scope, name: str) -> bool | None:
    """An optional boolean query parameter: False when the query is empty, its value for
    exactly `name=true` or `name=false`, None (not sure: let FastAPI parse it) otherwise."""
    query: bytes = scope.get("query_string", b"")
    if not query:
        return False
    key, _, value = query.partition(b"=")
    if key != name.encode():
        return None
    return _FLAGS.get(value)


def parsed(scope: Scope, body: bytes, model: type[M]) -> M | None:
    """The JSON body as `model`, as FastAPI would parse it (json, then the model), or None
    when FastAPI is to answer: another content type, malformed JSON, or a refusal."""
    if not _json_content(scope):
        return None
    try:
        return model.model_validate(json.loads(body))
    # JSONDecodeError and UnicodeDecodeError too; RecursionError: nested past the parser.
    except (ValueError, ValidationError, RecursionError):
        return None


def _json_content(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = bytes(value).split(b";", 1)[0].strip().lower()
            return media == b"application/json"
    return False


async def _read(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replayed(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _handler(app: Any, exc: Exception) -> Callable[..., Any] | None:
    """The app's exception handler for `exc` (the nearest class in its MRO), as Starlette's
    exception middleware looks it up."""
    handlers: dict[Any, Any] = getattr(app, "exception_handlers", {})
    for cls in type(exc).__mro__:
        if cls in handlers:
            found: Callable[..., Any] = handlers[cls]
            return found
    return None
