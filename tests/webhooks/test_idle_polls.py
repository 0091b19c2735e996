"""An idle webhook dispatcher looks in the database rarely (its looks 30 s apart here), yet a
retry it scheduled and a consumer's update that makes its copies due are posted at once
(docs/decisions/034-idle-polls.md)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from aiohttp import web

from queuekeeper.config import Settings
from tests.consumers.scopes import SERVICE, staff
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.webhooks.support import (
    WEBHOOK_SETTINGS,
    consumer_row,
    copies,
    due_now,
    eventually,
    gone_once,
    receiving,
)
from tests.webhooks.test_registration import register_webhook

IDLE = {**WEBHOOK_SETTINGS, "relay_poll_interval": 30.0, "relay_idle_poll_max": 30.0}


async def unavailable_once(_request: web.Request, number: int) -> web.StreamResponse:
    return web.Response(status=503 if number == 0 else 200)


@pytest.mark.settings(**{**IDLE, "webhook_retry_seconds": "1"})
async def test_a_retry_the_dispatcher_scheduled_is_posted_when_due(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    _agent, offering = await backend.agent_with_offering()
    admin = await staff(backend)
    async with receiving(unavailable_once) as receiver:
        hook = await register_webhook(admin, {"webhook_url": receiver.url})
        assert hook.status_code == 201, hook.text
        await post_event(client, order_event(offering, event_id="idle-retry"))
        (failed,) = await receiver.wait_for(1)
        # Due after 1-1.2 s; the next look of an idle dispatcher is 30 s away.
        _, again = await receiver.wait_for(2, timeout=10.0)
        assert again.at - failed.at < 10.0
        assert receiver.ids() == ["idle-retry", "idle-retry"]


@pytest.mark.settings(**{**IDLE, "webhook_retry_seconds": "60"})
async def test_an_update_that_makes_copies_due_is_announced(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    _agent, offering = await backend.agent_with_offering()
    admin = await staff(backend)
    async with receiving(unavailable_once) as receiver:
        hook = (await register_webhook(admin, {"webhook_url": receiver.url})).json()
        await post_event(client, order_event(offering, event_id="idle-update"))
        await receiver.wait_for(1)

        async def failed() -> bool:  # settled: due again in 60 s
            (copy,) = await copies(settings, uuid.UUID(hook["uuid"]))
            return copy["claimed_by"] is None and copy["attempts"] == 1

        await eventually(failed, what="the failed attempt settled")
        updated = await client.post(
            f"/api/event-consumers/{hook['uuid']}/update_webhook/", json={}, headers=SERVICE
        )
        assert updated.status_code == 200, updated.text
        started = time.monotonic()
        # Due now, and announced (NOTIFY), as an insert's copies are: not 30 s later.
        await receiver.wait_for(2, timeout=10.0)
        assert time.monotonic() - started < 10.0
        assert receiver.ids() == ["idle-update", "idle-update"]


@pytest.mark.settings(**IDLE)
async def test_copies_waiting_behind_a_gone_webhook_are_posted_once_it_is_updated(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """Copies accepted while the receiver was gone (410) are due already but not claimed:
    the update that ends the block is what makes them deliverable, and it is announced
    even when it moves no copy's due time."""
    _agent, offering = await backend.agent_with_offering()
    admin = await staff(backend)
    async with receiving(gone_once) as receiver:
        hook = (await register_webhook(admin, {"webhook_url": receiver.url})).json()
        key = uuid.UUID(hook["uuid"])
        await post_event(client, order_event(offering, event_id="gone-first"))
        await receiver.wait_for(1)

        async def gone() -> bool:
            return (await consumer_row(settings, key))["webhook_gone_at"] is not None

        await eventually(gone, what="webhook_gone_at set")
        await post_event(client, order_event(offering, event_id="gone-second"))
        waiting = await copies(settings, key)
        assert [c["state"] for c in waiting] == ["pending", "pending"]
        # Made due by nothing but the update: no copy's due time lies ahead.
        await due_now(settings, key)
        updated = await client.post(
            f"/api/event-consumers/{hook['uuid']}/update_webhook/", json={}, headers=SERVICE
        )
        assert updated.status_code == 200, updated.text
        started = time.monotonic()
        await receiver.wait_for(3, timeout=10.0)
        assert time.monotonic() - started < 10.0  # not the idle dispatcher's 30 s look
        assert receiver.ids() == ["gone-first", "gone-first", "gone-second"]
