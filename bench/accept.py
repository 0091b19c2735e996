"""The HTTP side of accepting one event, against a bare Starlette route doing the same parse.

In-process and with the intake replaced by one that answers at once, so what is timed
is everything between the server and the intake: middleware (request id, access line,
metrics, the request guard), routing, authentication, body parsing and validation, the
payload check, and encoding the answer. The raw baseline, measured in the same run, is a
Starlette app with one route that reads the body, validates it with the same pydantic
model and answers the same JSON: the least any HTTP accept can cost in this stack.
Process CPU per request, best of 5 rounds of 3,000 (after 500 to warm up).

    .venv/bin/python -m bench accept
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from asgi_lifespan import LifespanManager
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message

from bench._support import bench_database
from bench.publish import TOKEN, _payload
from queuekeeper.app import create_app
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Accepted
from queuekeeper.events.schemas import EventAccepted, EventIn
from queuekeeper.logging import configure_logging

ROUNDS = 5
REQUESTS = 3000
PATH = "/api/internal/events/"


def _scope(body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }


async def _cpu_per_request(app: ASGIApp, body: bytes) -> float:
    """Best of ROUNDS: process CPU seconds per request; every answer must be a 202."""
    statuses: set[int] = set()

    async def once() -> None:
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # never disconnects
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.add(message["status"])

        await app(_scope(body), receive, send)

    for _ in range(500):
        await once()
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.process_time()
        for _ in range(REQUESTS):
            await once()
        best = min(best, (time.process_time() - started) / REQUESTS)
    if statuses != {202}:
        raise RuntimeError(f"expected only 202 answers, got {sorted(statuses)}")
    return best


def _accepted(event: EventIn) -> EventAccepted:
    return EventAccepted(
        event_id=event.event_id or "", queued=1, skipped_unregistered=0, duplicate=False
    )


def _bare_app() -> Starlette:
    async def accept(request: Request) -> Response:
        event = EventIn.model_validate_json(await request.body())
        encoded = _accepted(event).model_dump_json(exclude_none=True)
        return Response(encoded, 202, media_type="application/json")

    return Starlette(routes=[Route(PATH, accept, methods=["POST"])])


async def _answer_at_once(
    events: Sequence[EventIn], _bodies: list[dict[str, Any]], _prefix: str
) -> Accepted:
    return Accepted([_accepted(event) for event in events], len(events))


async def run(url: str) -> None:
    settings = Settings(
        database_url=url,
        service_tokens=[TOKEN],
        relay_enabled=False,
        scheduler_enabled=False,
        log_format="json",
    )
    # The service's own logging set-up (the access line is part of what is measured),
    # written where a production process would write it, minus the disk.
    with open("/dev/null", "w") as sink:
        configure_logging(settings, stream=sink)
        body = json.dumps(
            {
                "event_id": uuid.uuid4().hex,
                "offering_uuid": uuid.uuid4().hex,
                "object_type": "order",
                "payload": _payload(700),
            }
        ).encode()
        bare = await _cpu_per_request(_bare_app(), body)
        app = create_app(settings)
        async with LifespanManager(app):
            app.state.queuekeeper.intake.accept = _answer_at_once
            service = await _cpu_per_request(app, body)
    logging.getLogger().handlers.clear()
    print(f"bare Starlette route (parse, validate, answer): {bare * 1e6:6.0f} µs CPU per request")
    print(f"queuekeeper accept route, intake answering at once: {service * 1e6:6.0f} µs CPU")
    print(
        f"HTTP side of one accept: x{service / bare:.2f} the bare route "
        f"(+{(service - bare) * 1e6:.0f} µs: request id, access line, metrics, guard, routing)"
    )


def main() -> None:
    with bench_database() as url:
        asyncio.run(run(url))


if __name__ == "__main__":
    main()
