"""The webhook tests' receiver (a real HTTP server on 127.0.0.1, ephemeral port) and a
webhook consumer made in the database (the registration endpoints are the API's)."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from sqlalchemy import text

from queuekeeper.broker.topology import webhook_queue_name
from queuekeeper.config import Settings
from queuekeeper.db import create_engine

# A receiver answers each request with this: given the request and its number (from 0).
Answer = Callable[[web.Request, int], Awaitable[web.StreamResponse]]

# The settings every webhook test runs with: loopback allowed, short timeout and retries.
WEBHOOK_SETTINGS: dict[str, Any] = {
    "webhook_allowed_networks": "127.0.0.1/32",
    "webhook_timeout_seconds": 1.0,
    "webhook_retry_seconds": "0.2,0.4",
    "relay_poll_interval": 0.1,
}


async def ok(_request: web.Request, _number: int) -> web.StreamResponse:
    return web.Response(status=200, text="ok")


async def gone_once(_request: web.Request, number: int) -> web.StreamResponse:
    """410 to the first post (the consumer is disabled until its update), 200 after."""
    return web.Response(status=410 if number == 0 else 200)


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic()


@dataclass
class Receiver:
    """Records every POST, then answers it with `answer`."""

    answer: Answer = ok
    received: list[Received] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        number = len(self.received)
        self.received.append(Received(dict(request.headers), body, time.monotonic()))
        return await self.answer(request, number)

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def ids(self) -> list[str]:
        return [r.headers["webhook-id"] for r in self.received]

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"received {len(self.received)} of {count}: {self.ids()}")
            await asyncio.sleep(0.02)
        return self.received


@asynccontextmanager
async def receiving(answer: Answer = ok) -> AsyncIterator[Receiver]:
    receiver = Receiver(answer)
    await receiver.start()
    try:
        yield receiver
    finally:
        await receiver.stop()


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


@dataclass
class Hook:
    uuid: uuid.UUID
    secret: str
    queue_name: str


async def webhook_consumer(
    settings: Settings,
    owner: uuid.UUID,
    offering: uuid.UUID,
    url: str,
    *,
    object_types: list[str] | None = None,
) -> Hook:
    """A webhook consumer of `owner` bound to `offering`, as registration would leave it."""
    consumer = uuid.uuid4()
    secret = new_secret()
    name = webhook_queue_name(consumer)
    await on_database(
        settings,
        (
            "INSERT INTO event_consumers (uuid, user_uuid, object_types, queue_name,"
            " vhost, broker_state, auth_token_prefix, is_global, payload_filters,"
            " delivery, webhook_url, webhook_secret, last_error, created, modified)"
            " VALUES (:uuid, :owner, CAST(:types AS json), :name, :vhost, 'ok', '',"
            " false, '{}', 'webhook', :url, :secret, '', now(), now())",
            {
                "uuid": consumer,
                "owner": owner,
                "types": "[]" if not object_types else str(object_types).replace("'", '"'),
                "name": name,
                "vhost": owner.hex,
                "url": url,
                "secret": secret,
            },
        ),
        (
            "INSERT INTO event_consumer_scopes (consumer_uuid, offering_uuid)"
            " VALUES (:consumer, :offering)",
            {"consumer": consumer, "offering": offering},
        ),
    )
    return Hook(consumer, secret, name)


async def consumer_row(settings: Settings, consumer: uuid.UUID) -> dict[str, Any]:
    (row,) = await on_database(
        settings, ("SELECT * FROM event_consumers WHERE uuid = :uuid", {"uuid": consumer})
    )
    return row


async def copies(settings: Settings, consumer: uuid.UUID) -> list[dict[str, Any]]:
    """The consumer's copies in acceptance order."""
    return await on_database(
        settings,
        (
            "SELECT id, event_id, state, attempts, webhook, claimed_by, last_error,"
            " next_attempt_at, replay FROM deliveries WHERE consumer_uuid = :uuid ORDER BY id",
            {"uuid": consumer},
        ),
    )


async def due_now(settings: Settings, consumer: uuid.UUID) -> None:
    """The consumer's waiting copies due at once, as copies accepted while it was gone are."""
    await on_database(
        settings,
        (
            "UPDATE deliveries SET next_attempt_at = now() - interval '1 second'"
            " WHERE consumer_uuid = :uuid AND state = 'pending'",
            {"uuid": consumer},
        ),
    )


async def on_database(
    settings: Settings, *statements: tuple[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run `statements` in one transaction on an engine of their own (the test's database,
    beside the app's); returns the last one's rows (none for a statement without)."""
    engine = create_engine(settings)
    try:
        async with engine.begin() as connection:
            for statement, parameters in statements:
                result = await connection.execute(text(statement), parameters)
            rows = result.mappings().all() if result.returns_rows else []
    finally:
        await engine.dispose()
    return [dict(row) for row in rows]


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)
