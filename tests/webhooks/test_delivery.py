"""Webhook delivery (contract §13): a real receiver on 127.0.0.1, consumers in the database,
events through the internal endpoint, the dispatcher started beside the relay."""

from __future__ import annotations

import base64
import json
import time
import uuid

import httpx
import pytest
from aiohttp import web
from standardwebhooks import Webhook

from queuekeeper.config import Settings
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.webhooks.support import (
    WEBHOOK_SETTINGS,
    Receiver,
    consumer_row,
    copies,
    eventually,
    receiving,
    webhook_consumer,
)

pytestmark = pytest.mark.settings(**WEBHOOK_SETTINGS)


async def test_a_copy_is_posted_signed_with_the_body_a_queue_consumer_gets(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        answer = await post_event(client, order_event(offering, event_id="signed-1"))
        assert answer.status_code in (200, 202), answer.text
        assert answer.json()["queued"] == 1
        (got,) = await receiver.wait_for(1)
        # The library of the standard verifies id, timestamp and signature (it raises if not).
        payload = Webhook(hook.secret).verify(got.body, got.headers)
        assert got.headers["webhook-id"] == "signed-1"
        assert got.headers["Content-Type"] == "application/json"
        assert abs(int(got.headers["webhook-timestamp"]) - time.time()) < 30
        assert payload["object_type"] == "order"
        assert payload["schema_version"] == 1
        assert payload["offering_uuid"] == offering.hex
        assert "order_uuid" in payload

        async def delivered() -> bool:
            return [c["state"] for c in await copies(settings, hook.uuid)] == ["published"]

        await eventually(delivered, what="the copy written delivered")
        (copy,) = await copies(settings, hook.uuid)
        assert copy["webhook"] is True
        row = await consumer_row(settings, hook.uuid)
        assert row["last_delivered_at"] is not None
        assert row["webhook_failing_since"] is None
        assert row["last_error"] == ""


async def test_copies_arrive_in_order_and_a_failing_one_holds_back_the_later(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """The receiver fails twice (503, then 500) then accepts: the first copy is retried, the
    later ones wait behind it, and all arrive once each in acceptance order."""

    async def fail_twice(_request: web.Request, number: int) -> web.StreamResponse:
        return web.Response(status=(503, 500)[number] if number < 2 else 200)

    agent, offering = await backend.agent_with_offering()
    async with receiving(fail_twice) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        ids = [f"ordered-{n}" for n in range(5)]
        for event_id in ids:
            answer = await post_event(client, order_event(offering, event_id=event_id))
            assert answer.status_code in (200, 202), answer.text
        await receiver.wait_for(7)
        assert receiver.ids() == [ids[0], ids[0], *ids]

        async def all_delivered() -> bool:
            return all(c["state"] == "published" for c in await copies(settings, hook.uuid))

        await eventually(all_delivered, what="every copy delivered")
        first = (await copies(settings, hook.uuid))[0]
        assert first["attempts"] == 3
        row = await consumer_row(settings, hook.uuid)
        assert row["last_error"] == "HTTP 500"  # the last failure's, kept after recovery
        assert row["webhook_failing_since"] is None


async def test_a_failed_attempt_is_shown_on_the_consumer_until_one_succeeds(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    receiver = Receiver()
    await receiver.start()
    port = receiver.port
    await receiver.stop()  # nothing listens there now: connection refused
    hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
    await post_event(client, order_event(offering, event_id="outage-1"))
    await post_event(client, order_event(offering, event_id="outage-2"))

    async def failing() -> bool:
        row = await consumer_row(settings, hook.uuid)
        return row["last_error"] == "connection refused" and row["webhook_failing_since"]

    await eventually(failing, what="connection refused recorded")
    row = await consumer_row(settings, hook.uuid)
    since = row["webhook_failing_since"]
    assert row["last_error_at"] >= since
    # Still failing later: the run's start stays.
    await eventually(lambda: _attempts_at_least(settings, hook.uuid, 3), what="retried while down")
    assert (await consumer_row(settings, hook.uuid))["webhook_failing_since"] == since
    # The receiver comes back on its port: everything arrives, in order.
    async with receiving() as back:
        back.port = 0
        await back.stop()
        await back.start(port)
        await back.wait_for(2)
        assert back.ids() == ["outage-1", "outage-2"]

        async def recovered() -> bool:
            row = await consumer_row(settings, hook.uuid)
            return row["webhook_failing_since"] is None and row["last_delivered_at"] is not None

        await eventually(recovered, what="failing cleared")


async def _attempts_at_least(settings: Settings, consumer: uuid.UUID, attempts: int) -> bool:
    return (await copies(settings, consumer))[0]["attempts"] >= attempts


async def test_a_410_disables_the_consumer_and_keeps_its_copies(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    async def gone(_request: web.Request, _number: int) -> web.StreamResponse:
        return web.Response(status=410)

    agent, offering = await backend.agent_with_offering()
    async with receiving(gone) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="gone-1"))
        await receiver.wait_for(1)

        async def disabled() -> bool:
            return (await consumer_row(settings, hook.uuid))["webhook_gone_at"] is not None

        await eventually(disabled, what="webhook_gone_at set")
        await post_event(client, order_event(offering, event_id="gone-2"))
        await _quiet(1.0)
        assert len(receiver.received) == 1  # nothing more is posted
        assert [c["state"] for c in await copies(settings, hook.uuid)] == ["pending", "pending"]
        assert "410" in (await consumer_row(settings, hook.uuid))["last_error"]


async def _quiet(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


async def test_queue_consumers_copies_are_not_marked_webhook(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    from tests.consumers.test_delivery import consumer_for

    agent, offering = await backend.agent_with_offering()
    queue = await consumer_for(agent, offering, ["order"])
    answer = await post_event(client, order_event(offering, event_id="queue-1"), wait=True)
    assert answer.json()["deliveries"][0]["state"] == "published"
    assert queue.startswith("consumer_")
    body = json.dumps(answer.json())
    assert "webhook" not in body


async def test_a_credential_in_the_url_is_sent_as_basic_authorization(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        url = receiver.url.replace("http://", "http://hook-user:s%40cret@")
        await webhook_consumer(settings, agent.uuid, offering, url)
        await post_event(client, order_event(offering, event_id="with-credential"))
        (got,) = await receiver.wait_for(1)
        expected = "Basic " + base64.b64encode(b"hook-user:s@cret").decode()
        assert got.headers["Authorization"] == expected
