"""Parking and release on return (contract §11): a queue whose agent is away keeps its new
copies in the outbox, and gets them, in acceptance order and a bounded number at a time,
when a consumer is back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import COPIES_PARKED, COPIES_RELEASED
from queuekeeper.presence import repository as presence_repository
from tests.brokers import BROKER
from tests.events.support import (
    Registered,
    drain,
    order_event,
    post_batch,
    post_event,
    queue_depth,
    register,
)
from tests.helpers import Backend, Operator
from tests.parking.support import set_presence, wait_for_states

FAST = {"park_after_seconds": 60, "park_check_interval": 0.1}
DLQ = "waldur.dlq.messages"
pytestmark = pytest.mark.settings(**FAST)


async def _away(state: Runtime, backend: Backend, *, away_for: int) -> Registered:
    """A registered queue whose consumer left `away_for` seconds ago, as the gate sees it."""
    registered = await register(backend)
    await set_presence(
        state.sessions, registered.vhost, registered.queue_name, consumers=0, away_for=away_for
    )
    await asyncio.sleep(0.3)  # a few looks of the gate
    return registered


async def _post(client: httpx.AsyncClient, registered: Registered, ids: list[str]) -> None:
    await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids])


async def _expired_into_dlq(client: httpx.AsyncClient, registered: Any, ids: list[str]) -> None:
    """Publish `ids` to the queue (its consumer gone for less than park_after) and wait
    until they have expired into the vhost's dead-letter queue."""
    await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids], wait=True)
    for _ in range(100):
        if await queue_depth(registered.vhost, DLQ) == len(ids):
            break
        await asyncio.sleep(0.05)
    assert await queue_depth(registered.vhost, DLQ) == len(ids)


async def _received_on_return(
    vhost: str, queue: str, count: int, come_back: Callable[[], Awaitable[None]]
) -> list[str]:
    """Consume the queue, then say the consumer is back (`come_back`); what arrives."""
    received: list[str] = []
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(str(message.message_id))
            await message.ack()

        await declared.consume(take)
        await come_back()
        for _ in range(200):
            if len(received) >= count:
                break
            await asyncio.sleep(0.05)
    return received


async def test_copies_for_an_away_queue_park_and_go_out_in_order_when_it_returns(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await register(backend)
    queue, vhost = registered.queue_name, registered.vhost
    # Away for less than park_after: copies are still published.
    await set_presence(state.sessions, vhost, queue, consumers=0, away_for=30)
    await asyncio.sleep(0.3)
    await post_event(client, order_event(registered.offering, event_id="early"), wait=True)
    assert await queue_depth(vhost, queue) == 1

    # Away for longer: copies park, none reaches the broker.
    await set_presence(state.sessions, vhost, queue, consumers=0, away_for=120)
    await asyncio.sleep(0.3)
    parked_before = COPIES_PARKED._value.get()
    ids = [f"away-{n:03}" for n in range(60)]
    await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids[:30]])
    for event_id in ids[30:40]:
        await post_event(client, order_event(registered.offering, event_id=event_id))
    await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids[40:]])
    await wait_for_states(state.sessions, queue, {"published": 1, "parked": 60})
    assert await queue_depth(vhost, queue) == 1
    assert COPIES_PARKED._value.get() - parked_before == 60
    detail = (await client.get("/api/internal/events/away-000/", headers=_service())).json()
    assert detail["deliveries"][0]["state"] == "parked"
    # A backend waiting for the copies hears at once that they are parked, and why.
    started = asyncio.get_running_loop().time()
    answer = await post_event(
        client, order_event(registered.offering, event_id="waited"), wait=True
    )
    assert asyncio.get_running_loop().time() - started < 5
    (copy,) = answer.json()["deliveries"]
    assert copy["state"] == "parked"
    assert copy["reason"].startswith("parked: its queue has had no consumer")
    ids.append("waited")

    # A consumer returns: everything parked goes out, oldest first.
    released_before = COPIES_RELEASED._value.get()
    await set_presence(state.sessions, vhost, queue, consumers=1)
    await wait_for_states(state.sessions, queue, {"published": 62})
    received = [m.message_id for m in await drain(vhost, queue)]
    assert received == ["early", *ids]
    assert COPIES_RELEASED._value.get() - released_before == 61

    # Once the backlog is out, new copies reach the queue again (within a look of the gate).
    await post_event(client, order_event(registered.offering, event_id="after"))
    await wait_for_states(state.sessions, queue, {"published": 63})
    assert [m.message_id for m in await drain(vhost, queue)] == ["after"]


@pytest.mark.settings(**FAST, park_release_max_in_flight=7)
async def test_a_release_never_fills_the_queue_past_its_bound(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await _away(state, backend, away_for=3600)
    queue, vhost = registered.queue_name, registered.vhost
    ids = [f"bound-{n:02}" for n in range(40)]
    await _post(client, registered, ids)
    await wait_for_states(state.sessions, queue, {"parked": 40})

    # Presence says a consumer is back; a slow one takes a message now and then.
    await set_presence(state.sessions, vhost, queue, consumers=1)
    received: list[str] = []
    deepest = 0
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        for _ in range(400):
            deepest = max(deepest, await queue_depth(vhost, queue))
            message = await declared.get(fail=False, no_ack=True)
            if message is not None:
                received.append(str(message.message_id))
            if len(received) == len(ids):
                break
            await asyncio.sleep(0.05)
    assert received == ids
    assert 0 < deepest <= 7


async def test_newer_copies_park_behind_a_backlog_until_it_is_out(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await _away(state, backend, away_for=3600)
    queue, vhost = registered.queue_name, registered.vhost
    first = [f"first-{n:02}" for n in range(20)]
    await _post(client, registered, first)
    await wait_for_states(state.sessions, queue, {"parked": 20})
    # Back, and events keep coming while the backlog is released: none overtakes it.
    await set_presence(state.sessions, vhost, queue, consumers=1)
    second = [f"second-{n:02}" for n in range(20)]
    for event_id in second:
        await post_event(client, order_event(registered.offering, event_id=event_id))
    await wait_for_states(state.sessions, queue, {"published": 40})
    assert [m.message_id for m in await drain(vhost, queue)] == [*first, *second]


def _service() -> dict[str, str]:
    from tests.events.support import SERVICE

    return SERVICE


@pytest.mark.settings(**FAST, queue_message_ttl_ms=300)
async def test_dead_letters_expired_while_away_come_back_first_then_the_parked_copies(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, operator: Operator
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await register(backend)
    queue, vhost = registered.queue_name, registered.vhost
    # Gone for less than park_after: copies are published, expire unread, dead-lettered.
    await set_presence(state.sessions, vhost, queue, consumers=0, away_for=30)
    await asyncio.sleep(0.3)
    expired = [f"expired-{n}" for n in range(5)]
    await _expired_into_dlq(client, registered, expired)
    # Past park_after: new copies park; a redrive meanwhile leaves the dead letters be.
    await set_presence(state.sessions, vhost, queue, consumers=0, away_for=120)
    await asyncio.sleep(0.3)
    parked = [f"parked-{n}" for n in range(10)]
    await _post(client, registered, parked)
    await wait_for_states(state.sessions, queue, {"published": 5, "parked": 10})
    run = await operator.redrive(vhost)
    assert run["found"].get("left_agent_away") == 5, run
    assert await queue_depth(vhost, DLQ) == 5

    # The agent subscribes: its dead letters first, then what was parked, in order.
    received = await _received_on_return(
        vhost, queue, 15, lambda: set_presence(state.sessions, vhost, queue, consumers=1)
    )
    assert received == [*expired, *parked]
    assert await queue_depth(vhost, DLQ) == 0


@pytest.mark.settings(**FAST, queue_message_ttl_ms=300)
async def test_a_return_redrives_the_dead_letters_even_when_nothing_was_parked(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """Away for less than park_after: nothing parks, but what was published meanwhile
    expired into the dead-letter queue; the return alone brings it back."""
    state: Runtime = app.state.queuekeeper
    registered = await _away(state, backend, away_for=30)
    queue, vhost = registered.queue_name, registered.vhost
    expired = [f"expired-{n}" for n in range(3)]
    await _expired_into_dlq(client, registered, expired)

    async def come_back() -> None:  # what the presence listener writes on the arrival
        async with state.sessions() as session:
            await presence_repository.record(
                session, vhost, queue, 1, observed=utcnow(), away_from=utcnow()
            )
            await session.commit()

    received = await _received_on_return(vhost, queue, 3, come_back)
    assert received == expired
    assert await queue_depth(vhost, DLQ) == 0


@pytest.mark.settings(**FAST, queue_type="quorum")
async def test_a_quorum_queue_parks_and_releases_in_order_too(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await _away(state, backend, away_for=3600)
    queue, vhost = registered.queue_name, registered.vhost
    ids = [f"quorum-{n:02}" for n in range(30)]
    await _post(client, registered, ids)
    await wait_for_states(state.sessions, queue, {"parked": 30})
    assert await queue_depth(vhost, queue) == 0
    await set_presence(state.sessions, vhost, queue, consumers=1)
    await wait_for_states(state.sessions, queue, {"published": 30})
    assert [m.message_id for m in await drain(vhost, queue)] == ids
