"""Webhook consumers end to end (contract §13): registered through the API, delivered to a real
receiver on 127.0.0.1 with the secret the registration showed once; resync through the same
path; a 410 blocks until `update_webhook`."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web
from standardwebhooks import Webhook

from tests.consumers.scopes import SERVICE, role, staff, tree
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.webhooks.support import WEBHOOK_SETTINGS, gone_once, receiving
from tests.webhooks.test_registration import register_webhook

pytestmark = pytest.mark.settings(**WEBHOOK_SETTINGS)


async def test_registered_through_the_api_then_delivered_signed_resync_too(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    place = await tree(client)
    user = await backend.put_user()
    await role(client, user, "project", place.project)
    admin = await staff(backend)
    async with receiving() as receiver:
        made = await register_webhook(admin, {"webhook_url": receiver.url + "?key=secret"})
        assert made.status_code == 201, made.text
        hook = made.json()
        secret = hook["webhook_secret"]
        answer = await post_event(client, order_event(place.offering, event_id="e2e-1"))
        assert answer.json()["queued"] == 1, answer.text
        (first,) = await receiver.wait_for(1)
        assert Webhook(secret).verify(first.body, first.headers)["object_type"] == "order"
        started = await client.post(f"/api/event-consumers/{hook['uuid']}/resync/", headers=SERVICE)
        assert started.status_code == 202
        got = await receiver.wait_for(2)
        snapshot = Webhook(secret).verify(got[1].body, got[1].headers)
        assert snapshot["event_type"] == "role_snapshot"
        assert snapshot["user_uuid"] == user.uuid.hex
        one = (await client.get(f"/api/event-consumers/{hook['uuid']}/", headers=SERVICE)).json()
        assert one["last_delivered_at"] is not None
        # The receiver has the post before the dispatcher has its answer and settles it.
        for _ in range(100):
            status = (
                await client.get(f"/api/event-consumers/{hook['uuid']}/status/", headers=SERVICE)
            ).json()
            if status["pending"] == 0:
                break
            await asyncio.sleep(0.05)
        assert status["pending"] == 0, status
        assert status["delivery_blocked_reason"] is None


async def test_a_410_blocks_until_update_webhook(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    _agent, offering = await backend.agent_with_offering()
    admin = await staff(backend)
    async with receiving(gone_once) as receiver:
        hook = (await register_webhook(admin, {"webhook_url": receiver.url})).json()
        await post_event(client, order_event(offering, event_id="e2e-gone"))
        await receiver.wait_for(1)
        path = f"/api/event-consumers/{hook['uuid']}/"
        for _ in range(50):
            one = (await client.get(path, headers=SERVICE)).json()
            if one["delivery_blocked_reason"] == "webhook_gone":
                break
            await asyncio.sleep(0.1)
        assert one["delivery_blocked_reason"] == "webhook_gone", one
        status = (
            await client.get(f"/api/event-consumers/{hook['uuid']}/status/", headers=SERVICE)
        ).json()
        assert status["delivery_blocked_reason"] == "webhook_gone"
        assert status["pending"] == 1, status
        updated = await client.post(
            f"/api/event-consumers/{hook['uuid']}/update_webhook/", json={}, headers=SERVICE
        )
        assert updated.status_code == 200
        assert updated.json()["delivery_blocked_reason"] is None
        await receiver.wait_for(2)
        assert receiver.ids() == ["e2e-gone", "e2e-gone"]


# The first attempt is held until the update has been answered and a while after: a timeout
# well beyond that, so a loaded machine's slow update never turns the attempt into a failure.
@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_timeout_seconds": 15.0})
async def test_update_webhook_during_an_attempt_keeps_one_at_a_time_in_order(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """An update makes waiting copies due now, not those an attempt holds: the next claim
    would post them beside it."""
    in_flight, most = 0, 0
    first_arrived, update_answered = asyncio.Event(), asyncio.Event()

    async def slow_first(_request: web.Request, number: int) -> web.StreamResponse:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            if number == 0:
                first_arrived.set()
                # Held while the update is made and for several of the dispatcher's polls
                # (relay_poll_interval 0.1 s) after it: a second run claimed then would post
                # beside this one.
                await asyncio.wait_for(update_answered.wait(), 10)
                await asyncio.sleep(0.5)
            return web.Response(status=200)
        finally:
            in_flight -= 1

    _agent, offering = await backend.agent_with_offering()
    admin = await staff(backend)
    async with receiving(slow_first) as receiver:
        hook = (await register_webhook(admin, {"webhook_url": receiver.url})).json()
        for n in range(3):
            await post_event(client, order_event(offering, event_id=f"upd-{n}"))
        await asyncio.wait_for(first_arrived.wait(), 10)
        updated = await client.post(
            f"/api/event-consumers/{hook['uuid']}/update_webhook/",
            json={"webhook_url": receiver.url},
            headers=SERVICE,
        )
        assert updated.status_code == 200, updated.text
        update_answered.set()
        await receiver.wait_for(3)
        await asyncio.sleep(0.5)  # a second run, if one were claimed, would have posted
        assert receiver.ids() == ["upd-0", "upd-1", "upd-2"]
        assert most == 1
