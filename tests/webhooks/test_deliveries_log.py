"""What a webhook consumer can see of its deliveries (contract §14): each copy's state and
attempts, from a real receiver on 127.0.0.1 through the dispatcher, read back through
`GET /api/event-consumers/{uuid}/deliveries/` and its `{event_id}/` detail."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from aiohttp import web

from queuekeeper.config import Settings
from queuekeeper.models import utcnow
from tests.events.support import order_event, post_event
from tests.helpers import Agent, Backend
from tests.webhooks.support import (
    WEBHOOK_SETTINGS,
    copies,
    eventually,
    receiving,
    webhook_consumer,
)

pytestmark = pytest.mark.settings(**WEBHOOK_SETTINGS)


def _path(consumer: uuid.UUID, event_id: str = "") -> str:
    return f"/api/event-consumers/{consumer.hex}/deliveries/" + (f"{event_id}/" if event_id else "")


async def _detail(agent: Agent, consumer: uuid.UUID, event_id: str) -> dict[str, Any]:
    answer = await agent.client.get(_path(consumer, event_id), headers=agent.headers)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


async def test_a_failed_attempt_then_a_delivery_are_both_in_the_attempt_log(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    async def failing_once(_request: web.Request, number: int) -> web.StreamResponse:
        return web.Response(status=503 if number == 0 else 200)

    agent, offering = await backend.agent_with_offering()
    async with receiving(failing_once) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="log-1"))
        await receiver.wait_for(2)

        async def delivered() -> bool:
            return [c["state"] for c in await copies(settings, hook.uuid)] == ["published"]

        await eventually(delivered, what="the copy delivered after its retry")
        item = await _detail(agent, hook.uuid, "log-1")
    assert item["state"] == "delivered"
    assert item["replay"] is False
    assert item["attempts"] == 2
    assert item["last_status"] == 200
    assert item["delivered_at"] is not None
    assert item["next_attempt_at"] is None
    assert item["given_up_reason"] is None
    assert item["last_error"] == "HTTP 503"  # what went wrong last, kept after the delivery
    failed, succeeded = item["attempt_log"]
    assert (failed["status"], failed["error"]) == (503, "HTTP 503")
    assert (succeeded["status"], succeeded["error"]) == (200, None)
    for attempt in (failed, succeeded):
        assert isinstance(attempt["duration_ms"], int)
        assert 0 <= attempt["duration_ms"] < 1000
    assert failed["at"] < succeeded["at"] == item["last_attempt_at"]
    assert item["delivered_at"] == succeeded["at"]
    # The list shows the same copy without the log.
    listed = await client.get(_path(hook.uuid), headers=agent.headers)
    (row,) = listed.json()
    assert "attempt_log" not in row
    assert {k: v for k, v in item.items() if k != "attempt_log"} == row


async def test_a_replayed_copy_is_listed_as_a_replay_beside_the_first(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        since = (utcnow() - timedelta(minutes=1)).isoformat()
        await post_event(client, order_event(offering, event_id="again-1"))
        await receiver.wait_for(1)

        async def settled() -> bool:
            return [c["state"] for c in await copies(settings, hook.uuid)] == ["published"]

        await eventually(settled, what="the first copy delivered")
        replayed = await client.post(
            f"/api/event-consumers/{hook.uuid.hex}/replay/",
            json={"since": since},
            headers=agent.headers,
        )
        assert replayed.status_code == 202, replayed.text
        await receiver.wait_for(2)

        async def both() -> bool:
            states = [c["state"] for c in await copies(settings, hook.uuid)]
            return states == ["published", "published"]

        await eventually(both, what="the replay's copy delivered")
    listed = (
        await client.get(_path(hook.uuid), params={"event_id": "again-1"}, headers=agent.headers)
    ).json()
    assert [(row["replay"], row["state"]) for row in listed] == [
        (True, "delivered"),
        (False, "delivered"),
    ]
    assert (await _detail(agent, hook.uuid, "again-1"))["replay"] is True  # the newest copy


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_retry_seconds": "0.5"})
async def test_a_copy_refused_when_it_leaves_is_given_up_as_not_authorized(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    async def unavailable(_request: web.Request, _number: int) -> web.StreamResponse:
        return web.Response(status=503)

    agent, offering = await backend.agent_with_offering()
    async with receiving(unavailable) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="refused-1"))
        await receiver.wait_for(1)
        # The owner's token ends: the retry is judged as it leaves and given up.
        await backend.expire_token_at(agent, utcnow() - timedelta(seconds=1))

        async def given_up() -> bool:
            return [c["state"] for c in await copies(settings, hook.uuid)] == ["given_up"]

        await eventually(given_up, what="the copy given up")
    service = {"Authorization": backend.headers["Authorization"]}
    item = (await client.get(_path(hook.uuid, "refused-1"), headers=service)).json()
    assert item["state"] == "given_up"
    assert item["given_up_reason"] == "not_authorized"
    assert item["next_attempt_at"] is None
    assert item["delivered_at"] is None
    assert item["last_status"] == 503  # the attempt that was made
    assert [a["status"] for a in item["attempt_log"]] == [503]
    filtered = await client.get(_path(hook.uuid), params={"state": "given_up"}, headers=service)
    assert [row["event_id"] for row in filtered.json()] == ["refused-1"]
    assert (
        await client.get(_path(hook.uuid), params={"state": "pending"}, headers=service)
    ).json() == []


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_retry_seconds": "30"})
async def test_status_says_when_the_head_is_tried_next_not_a_held_back_copys_stale_time(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    async def unavailable(_request: web.Request, _number: int) -> web.StreamResponse:
        return web.Response(status=503)

    agent, offering = await backend.agent_with_offering()
    async with receiving(unavailable) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await client.post(
            "/api/internal/events/batch/",
            json={"events": [order_event(offering, event_id=f"held-{n}") for n in range(3)]},
            headers=backend.headers,
        )
        await receiver.wait_for(1)

        async def retrying() -> bool:
            rows = await copies(settings, hook.uuid)
            return len(rows) == 3 and rows[0]["claimed_by"] is None and rows[0]["attempts"] == 1

        await eventually(retrying, what="the head failed and waits for its retry")
        status = (
            await client.get(f"/api/event-consumers/{hook.uuid.hex}/status/", headers=agent.headers)
        ).json()
        head = (await copies(settings, hook.uuid))[0]
    assert status["delivery_blocked_reason"] == "webhook_failing"
    assert status["pending"] == 3
    # The head is retried after 30 s (plus jitter); the copies behind it were released with
    # a due time in the past, which says nothing while the head holds them back.
    next_at = status["next_attempt_at"]
    assert next_at is not None
    assert datetime.fromisoformat(next_at.replace("Z", "+00:00")) == head["next_attempt_at"]
    assert head["next_attempt_at"] > utcnow() + timedelta(seconds=20)
    assert len(receiver.received) == 1
