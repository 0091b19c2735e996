"""A status call's `dead_letters` comes from a census of the vhost's dead-letter queue kept in
the background (docs/decisions/023-dead-letter-census.md): the call never drains the queue
itself, so it is quick whatever the queue holds, concurrent calls agree, and every dead
letter stays where it was, in order."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import aio_pika
import httpx
import pytest

from tests.brokers import BROKER
from tests.helpers import Agent, Backend
from tests.presence.test_presence import SERVICE, register, status

DLQ = "waldur.dlq.messages"
MANY = 2_000


def dead_letter(queue: str, number: int) -> aio_pika.Message:
    """A message as RabbitMQ dead-letters an expired copy of `queue`."""
    return aio_pika.Message(
        b'{"order_uuid": "x"}',
        message_id=f"{queue}-{number}",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers={
            "x-death": [
                {
                    "queue": queue,
                    "reason": "expired",
                    "count": 1,
                    "exchange": "",
                    "routing-keys": [queue],
                    "time": datetime.now(UTC).replace(microsecond=0),
                }
            ],
            "x-first-death-queue": queue,
        },
    )


async def dead_letter_into(vhost: str, counts: dict[str, int]) -> None:
    """Put dead letters of these queues into the vhost's dead-letter queue, confirmed."""
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for queue, count in counts.items():
            for start in range(0, count, 200):
                await asyncio.gather(
                    *(
                        channel.default_exchange.publish(
                            dead_letter(queue, number), routing_key=DLQ
                        )
                        for number in range(start, min(start + 200, count))
                    )
                )


async def dead_letter_ids(vhost: str) -> list[str]:
    """The message ids in the dead-letter queue, in its order; all given back (unacked)."""
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    ids: list[str] = []
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(DLQ, passive=True)
        for _ in range(queue.declaration_result.message_count or 0):
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            ids.append(message.message_id or "")
    return ids


async def consumer_with_dead_letters(
    backend: Backend, own: int, others: int = 25
) -> tuple[Agent, dict[str, Any]]:
    agent, offering = await backend.agent_with_offering()
    registration = await register(agent, offering)
    await dead_letter_into(
        agent.vhost, {registration["queue_name"]: own, "consumer_" + "0" * 32: others}
    )
    return agent, registration


async def counted(
    client: httpx.AsyncClient, consumer: str, after: datetime | None = None
) -> dict[str, Any]:
    """Poll the status until a census (newer than `after`) answers (with the service token:
    polling is not the agent's rate limit's business)."""
    deadline = time.monotonic() + 10
    while True:
        answer = await status(client, consumer, SERVICE)
        at = answer["dead_letters_counted_at"]
        if at is not None and (after is None or datetime.fromisoformat(at) > after):
            return answer
        assert time.monotonic() < deadline, answer
        await asyncio.sleep(0.1)


async def test_a_status_call_answers_at_once_and_every_dead_letter_stays_in_order(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, registration = await consumer_with_dead_letters(backend, MANY)
    consumer = registration["rmq_username"]
    before = await dead_letter_ids(agent.vhost)
    assert len(before) == MANY + 25

    started = time.monotonic()
    first = await status(client, consumer, agent.headers)
    # The census runs beside the call; the call does not wait for it (it once took the
    # dead letters one basic.get at a time: 1.0-1.2 s for 2,000).
    assert time.monotonic() - started < 0.5
    if first["dead_letters_counted_at"] is None:
        assert first["dead_letters"] is None  # not counted yet, not "none"
    answer = await counted(client, consumer)
    assert answer["dead_letters"] == MANY

    # Later calls answer from that census, not by counting again (what the bench times).
    for _ in range(5):
        again = await status(client, consumer, agent.headers)
        assert again["dead_letters"] == MANY
        assert again["dead_letters_counted_at"] == answer["dead_letters_counted_at"]

    # Given back when the census closed its channel: the same messages, in the same order.
    assert await dead_letter_ids(agent.vhost) == before


async def test_concurrent_status_calls_agree(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, registration = await consumer_with_dead_letters(backend, MANY)
    consumer = registration["rmq_username"]
    # Ten at once, before any census of the vhost: they share one count.
    answers = await asyncio.gather(*(status(client, consumer, SERVICE) for _ in range(10)))
    assert len({(a["dead_letters"], a["dead_letters_counted_at"]) for a in answers}) == 1
    await counted(client, consumer)
    answers = await asyncio.gather(*(status(client, consumer, SERVICE) for _ in range(10)))
    assert {a["dead_letters"] for a in answers} == {MANY}
    assert len({a["dead_letters_counted_at"] for a in answers}) == 1
    assert len(await dead_letter_ids(agent.vhost)) == MANY + 25


@pytest.mark.settings(dead_letter_census_seconds=1)
async def test_the_census_is_taken_again_after_its_interval(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, registration = await consumer_with_dead_letters(backend, 3)
    consumer = registration["rmq_username"]
    first = await counted(client, consumer)
    assert first["dead_letters"] == 3
    await dead_letter_into(agent.vhost, {registration["queue_name"]: 4})
    # Within the interval the latest census answers, as it is.
    assert (await status(client, consumer, agent.headers))["dead_letters"] == 3
    later = await counted(
        client, consumer, after=datetime.fromisoformat(first["dead_letters_counted_at"])
    )
    assert later["dead_letters"] == 7


async def test_the_admin_queue_view_shares_the_census(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, registration = await consumer_with_dead_letters(backend, 5)
    answer = await counted(client, registration["rmq_username"])
    response = await client.get(
        "/api/admin/queues/", params={"vhost": agent.vhost}, headers=backend.headers
    )
    assert response.status_code == 200, response.text
    (row,) = [row for row in response.json() if row["queue_name"] == registration["queue_name"]]
    assert row["dead_letters"] == 5
    assert row["dead_letters_counted_at"] == answer["dead_letters_counted_at"]


@pytest.mark.settings(dead_letter_census_seconds=1)
async def test_dead_letters_another_reader_holds_are_not_waited_for(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, registration = await consumer_with_dead_letters(backend, 30, others=0)
    consumer = registration["rmq_username"]
    # A redrive in progress holds some unacknowledged: the census counts what it can see.
    connection = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(DLQ, passive=True)
        for _ in range(10):
            assert await queue.get(no_ack=False, fail=False) is not None
        started = time.monotonic()
        held = await counted(client, consumer)
        assert time.monotonic() - started < 5
        assert held["dead_letters"] == 20
    # Given back by the other reader: the next census sees them all again.
    after = datetime.fromisoformat(held["dead_letters_counted_at"])
    assert (await counted(client, consumer, after=after))["dead_letters"] == 30
    assert len(await dead_letter_ids(agent.vhost)) == 30
