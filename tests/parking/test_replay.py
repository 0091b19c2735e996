"""Replay (contract §11): a time window of events published again to a queue, in acceptance
order, with their original message_id and `x-queuekeeper-replay: "true"`."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import REPLAYS
from tests.consumers.test_delivery import consumer_for, resource_event
from tests.events.support import SERVICE, drain, order_event, post_batch, register
from tests.helpers import Agent, Backend, clear_of_a_window_edge


def _iso(moment: datetime) -> str:
    return moment.isoformat()


async def _moment() -> datetime:
    """A boundary strictly between what was accepted before and what comes after."""
    await asyncio.sleep(0.02)
    moment = utcnow()
    await asyncio.sleep(0.02)
    return moment


async def _replay(agent: Agent, consumer: str, body: dict[str, Any]) -> httpx.Response:
    return await agent.client.post(
        f"/api/event-consumers/{consumer}/replay/", json=body, headers=agent.headers
    )


async def test_a_consumer_replays_exactly_its_window_in_order_marked_as_replays(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    queue = await consumer_for(agent, offering)
    consumer = queue.removeprefix("consumer_")
    before = [order_event(offering, event_id=f"before-{n}") for n in range(3)]
    await post_batch(client, before, wait=True)
    since = await _moment()
    inside = [
        order_event(offering, event_id="in-0"),
        resource_event(offering, event_id="in-1"),
        order_event(offering, event_id="in-2"),
        resource_event(offering, event_id="in-3"),
    ]
    await post_batch(client, inside[:2], wait=True)
    await post_batch(client, inside[2:], wait=True)
    until = await _moment()
    await post_batch(client, [order_event(offering, event_id="after-0")], wait=True)
    originals = await drain(agent.vhost, queue)
    assert [m.message_id for m in originals] == [
        *(f"before-{n}" for n in range(3)),
        *(f"in-{n}" for n in range(4)),
        "after-0",
    ]
    assert all("x-queuekeeper-replay" not in (m.headers or {}) for m in originals)

    counted = REPLAYS.labels(caller="agent")._value.get()
    response = await _replay(agent, consumer, {"since": _iso(since), "until": _iso(until)})
    assert response.status_code == 202, response.text
    assert response.json() == {"replayed": 4}
    assert REPLAYS.labels(caller="agent")._value.get() - counted == 1
    replayed = await _drain_count(agent.vhost, queue, 4)
    assert [m.message_id for m in replayed] == ["in-0", "in-1", "in-2", "in-3"]
    assert {m.headers["x-queuekeeper-replay"] for m in replayed} == {"true"}
    by_id = {m.message_id: m.body for m in originals}
    assert all(m.body == by_id[m.message_id] for m in replayed)

    # Only some object types; `until` omitted is now.
    response = await _replay(agent, consumer, {"since": _iso(since), "object_types": ["resource"]})
    assert response.json() == {"replayed": 2}
    assert [m.message_id for m in await _drain_count(agent.vhost, queue, 2)] == ["in-1", "in-3"]

    # A service token may replay any consumer.
    response = await client.post(
        f"/api/event-consumers/{consumer}/replay/",
        json={"since": _iso(until)},
        headers=SERVICE,
    )
    assert response.json() == {"replayed": 1}
    assert [m.message_id for m in await _drain_count(agent.vhost, queue, 1)] == ["after-0"]


async def _drain_count(vhost: str, queue: str, count: int) -> list[Any]:
    taken: list[Any] = []
    for _ in range(200):
        taken.extend(await drain(vhost, queue))
        if len(taken) >= count:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    taken.extend(await drain(vhost, queue))  # nothing more than asked for
    return taken


async def test_bad_windows_and_other_users_consumers_are_refused(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    consumer = (await consumer_for(agent, offering)).removeprefix("consumer_")
    now = utcnow()
    cases = [
        ({"since": _iso(now + timedelta(hours=1))}, "since", "in the future"),
        (
            {"since": _iso(now - timedelta(hours=2)), "until": _iso(now - timedelta(hours=3))},
            "until",
            "before `since`",
        ),
        ({"since": _iso(now - timedelta(days=15))}, "since", "oldest time available"),
        ({"since": "yesterday"}, "since", ""),
        ({"since": _iso(now), "object_types": ["nope"]}, "object_types.0", "unknown"),
    ]
    for body, field, words in cases:
        response = await _replay(agent, consumer, body)
        assert response.status_code == 400, (body, response.text)
        answer = response.json()
        assert answer["errors"][0]["field"] == field, answer
        assert words in answer["detail"], answer
    old = await _replay(agent, consumer, {"since": _iso(now - timedelta(days=15))})
    oldest = datetime.fromisoformat(old.json()["oldest_available"])
    assert abs((oldest - (now - timedelta(days=14))).total_seconds()) < 60
    assert oldest.isoformat() in old.json()["detail"]

    stranger = await backend.put_user()
    response = await _replay(stranger, consumer, {"since": _iso(now)})
    assert response.status_code == 404, response.text
    response = await _replay(agent, "0" * 32, {"since": _iso(now)})
    assert response.status_code == 404


async def test_an_operator_replays_a_legacy_queue_by_name(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    since = await _moment()
    ids = [f"legacy-{n}" for n in range(5)]
    await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids], wait=True)
    await drain(registered.vhost, registered.queue_name)
    body = {"since": _iso(since), "queue_name": registered.queue_name, "vhost": registered.vhost}
    response = await client.post("/api/admin/queues/replay/", json=body, headers=SERVICE)
    assert response.status_code == 202, response.text
    assert response.json() == {"replayed": 5}
    replayed = await _drain_count(registered.vhost, registered.queue_name, 5)
    assert [m.message_id for m in replayed] == ids
    assert {m.headers["x-queuekeeper-replay"] for m in replayed} == {"true"}

    missing = {**body, "queue_name": "no_such_queue"}
    response = await client.post("/api/admin/queues/replay/", json=missing, headers=SERVICE)
    assert response.status_code == 404
    assert response.json()["errors"][0]["field"] == "queue_name"
    response = await client.post(
        "/api/admin/queues/replay/", json=body, headers=registered.agent.headers
    )
    assert response.status_code in (401, 403)


@pytest.mark.settings(registration_rate_limit="2/minute")
async def test_replays_are_rate_limited_like_other_agent_writes(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    await clear_of_a_window_edge()
    agent, offering = await backend.agent_with_offering()
    consumer = (await consumer_for(agent, offering)).removeprefix("consumer_")
    answers = [
        (await _replay(agent, consumer, {"since": _iso(utcnow())})).status_code for _ in range(3)
    ]
    assert answers[-1] == 429, answers
