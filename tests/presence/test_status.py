"""Why a queue is silent (contract §11): each `delivery_blocked_reason` produced for real,
on the consumer's status and on the admin queue view; 404, rate limit, and what waits for
the queue (parked copies, dead letters, the last delivery)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import delete

from queuekeeper.broker.management import ManagementClient
from queuekeeper.models import Delivery, DeliveryState, Event, OfferingAccess
from tests.conftest import SERVICE_TOKEN
from tests.events.support import order_event, post_event
from tests.helpers import Agent, Backend, clear_of_a_window_edge
from tests.presence.test_dead_letter_census import counted
from tests.presence.test_presence import register, status

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


async def consumer_of(backend: Backend, **body: Any) -> tuple[Agent, uuid.UUID, dict[str, Any]]:
    agent, offering = await backend.agent_with_offering()
    return agent, offering, await register(agent, offering, **body)


def reason(answer: dict[str, Any]) -> str | None:
    found: str | None = answer["delivery_blocked_reason"]
    if found is not None:
        assert answer["delivery_blocked_detail"], answer  # always a sentence saying what to do
    return found


async def test_a_consumer_that_receives_events_is_not_blocked(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering, registration = await consumer_of(backend)
    accepted = await post_event(client, order_event(offering), wait=True)
    assert accepted.status_code == 200, accepted.text
    answer = await status(client, registration["rmq_username"], agent.headers)
    assert reason(answer) is None
    assert answer["delivery_blocked_detail"] is None
    assert answer["parked"] == 0
    assert (await counted(client, registration["rmq_username"]))["dead_letters"] == 0
    last = datetime.fromisoformat(answer["last_delivered_at"])
    assert abs(last - datetime.now(UTC)) < timedelta(seconds=30)
    assert answer["uuid"] == registration["rmq_username"]
    assert answer["queue_name"] == registration["queue_name"]


async def test_owner_inactive_and_token_expired(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, _, registration = await consumer_of(backend)
    consumer = registration["rmq_username"]
    await backend.put_user(
        agent.uuid,
        token=agent.token,
        token_expires_at=(datetime.now(UTC) - timedelta(minutes=1)).isoformat(),
    )
    # The agent's own token no longer works: its operator asks through the backend.
    assert reason(await status(client, consumer, SERVICE)) == "token_expired"
    await backend.put_user(agent.uuid, token=agent.token, is_active=False)
    answer = await status(client, consumer, SERVICE)
    assert reason(answer) == "owner_inactive"  # checked first: it hides the token's expiry
    assert "reactivate" in answer["delivery_blocked_detail"]


async def test_a_removed_token_blocks_like_an_expired_one(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, _, registration = await consumer_of(backend)
    consumer = registration["rmq_username"]
    assert reason(await status(client, consumer, SERVICE)) is None
    await backend.put_user(agent.uuid, token=None)  # the marketplace removed the token
    answer = await status(client, consumer, SERVICE)
    assert reason(answer) == "no_token"
    assert "removed the owner's API token" in answer["delivery_blocked_detail"]
    assert f"/api/internal/users/{agent.uuid.hex}/" in answer["delivery_blocked_detail"]
    # An expiry still set on the removed token is the older news: the token's expiry first.
    await backend.put_user(
        agent.uuid,
        token=None,
        token_expires_at=(datetime.now(UTC) - timedelta(minutes=1)).isoformat(),
    )
    assert reason(await status(client, consumer, SERVICE)) == "token_expired"
    # A token pushed again: events flow.
    await backend.put_user(agent.uuid, token=agent.token, token_expires_at=None)
    assert reason(await status(client, consumer, agent.headers)) is None


async def test_no_access(app: FastAPI, backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering, registration = await consumer_of(backend)
    # A grant that is gone without the revocation call (a directory import that dropped it):
    # the consumer is still there, and no event reaches it.
    async with app.state.queuekeeper.sessions.begin() as session:
        await session.execute(
            delete(OfferingAccess).where(
                OfferingAccess.user_uuid == agent.uuid, OfferingAccess.offering_uuid == offering
            )
        )
    answer = await status(client, registration["rmq_username"], agent.headers)
    assert reason(answer) == "no_access"
    assert offering.hex in answer["delivery_blocked_detail"]
    # Revoked through the API, the consumer scoped only to it goes with it (contract §9).
    revoked = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=SERVICE
    )
    assert revoked.status_code == 204
    gone = await client.get(
        f"/api/event-consumers/{registration['rmq_username']}/status/", headers=agent.headers
    )
    assert gone.status_code == 404


async def test_queue_missing_misconfigured_and_broker_user_missing(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent, _, registration = await consumer_of(backend)
    consumer, vhost, queue = (
        registration["rmq_username"],
        registration["vhost"],
        registration["queue_name"],
    )
    assert await management.delete_user(consumer)
    assert reason(await status(client, consumer, agent.headers)) == "broker_user_missing"

    assert await management.delete_queue(vhost, queue)
    answer = await status(client, consumer, agent.headers)
    assert reason(answer) == "queue_missing"  # before the login: nothing can even be stored
    assert answer["ready"] is None

    await management.put_queue(vhost, queue, arguments={})
    answer = await status(client, consumer, agent.headers)
    assert reason(answer) == "queue_misconfigured"
    assert "x-message-ttl" in answer["delivery_blocked_detail"]


async def test_filter_matches_nothing(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering, registration = await consumer_of(backend, object_types=["order"])
    consumer = registration["rmq_username"]
    assert reason(await status(client, consumer, agent.headers)) is None  # nothing published
    resource = {
        "offering_uuid": offering.hex,
        "object_type": "resource",
        "payload": {"resource_uuid": uuid.uuid4().hex},
    }
    assert (await post_event(client, resource)).status_code == 202
    answer = await status(client, consumer, agent.headers)
    assert reason(answer) == "filter_matches_nothing"
    assert "resource" in answer["delivery_blocked_detail"]
    # An event its filter holds: the filter matches something again.
    assert (await post_event(client, order_event(offering))).status_code == 202
    assert reason(await status(client, consumer, agent.headers)) is None


@pytest.mark.settings(park_after_seconds=1, presence_interval_seconds=0)
async def test_agent_away_after_park_after(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, _, registration = await consumer_of(backend)
    consumer = registration["rmq_username"]
    first = await status(client, consumer, agent.headers)  # first sight: away from now on
    assert first["connected"] is False
    assert reason(first) is None  # not away for long enough yet
    away_since = first["away_since"]
    assert away_since is not None
    await asyncio.sleep(1.2)
    answer = await status(client, consumer, agent.headers)
    assert reason(answer) == "agent_away"
    assert answer["away_since"] == away_since
    assert registration["queue_name"] in answer["delivery_blocked_detail"]


async def test_parked_copies_are_counted_oldest_first(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    """Parked copies (written here as the parking relay writes them) are counted per queue."""
    agent, offering, registration = await consumer_of(backend)
    consumer = uuid.UUID(registration["rmq_username"])
    oldest = datetime(2026, 11, 20, 8, 0, tzinfo=UTC)
    async with app.state.queuekeeper.sessions.begin() as session:
        for minutes in (0, 5):
            event = Event(
                event_id=uuid.uuid4().hex,
                offering_uuid=offering,
                object_type="order",
                payload={"order_uuid": uuid.uuid4().hex},
                accepted=oldest + timedelta(minutes=minutes),
            )
            session.add(event)
            await session.flush()
            session.add(
                Delivery(
                    event_id=event.event_id,
                    consumer_uuid=consumer,
                    queue_name=registration["queue_name"],
                    vhost=registration["vhost"],
                    state=DeliveryState.PARKED,
                    created=oldest + timedelta(minutes=minutes),
                    parked_at=oldest + timedelta(minutes=minutes, seconds=30),
                )
            )
    answer = await status(client, consumer.hex, agent.headers)
    assert answer["parked"] == 2
    assert datetime.fromisoformat(answer["oldest_parked_at"]) == oldest


@pytest.mark.settings(queue_message_ttl_ms=200)
async def test_dead_letters_of_this_queue_are_counted_and_left_in_place(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent, offering, registration = await consumer_of(backend)
    _, other_offering, other_registration = await consumer_of(backend)
    for _ in range(3):
        assert (await post_event(client, order_event(offering), wait=True)).status_code == 200
    assert (await post_event(client, order_event(other_offering), wait=True)).status_code == 200
    await asyncio.sleep(1.0)  # the copies expire into the vhost's dead-letter queue
    first = await counted(client, registration["rmq_username"])
    assert first["dead_letters"] == 3
    assert (await status(client, registration["rmq_username"], agent.headers))[
        "dead_letters"
    ] == 3  # looking took nothing away
    assert (await counted(client, other_registration["rmq_username"]))["dead_letters"] == 1


async def test_another_users_consumer_is_not_found(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    _, _, registration = await consumer_of(backend)
    stranger = await backend.put_user()
    for path in (registration["rmq_username"], "not-a-uuid", uuid.uuid4().hex):
        response = await client.get(
            f"/api/event-consumers/{path}/status/", headers=stranger.headers
        )
        assert response.status_code == 404, response.text
        assert response.json()["detail"]


@pytest.mark.settings(registration_rate_limit="3/minute")
async def test_status_is_rate_limited_like_the_agent_writes(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    await clear_of_a_window_edge()
    agent, offering = await backend.agent_with_offering()
    registration = await register(agent, offering)  # counted: 1 of 3
    path = f"/api/event-consumers/{registration['rmq_username']}/status/"
    for _ in range(2):
        assert (await client.get(path, headers=agent.headers)).status_code == 200
    refused = await client.get(path, headers=agent.headers)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    # The backend's service token is not an agent's: not counted.
    assert (await client.get(path, headers=SERVICE)).status_code == 200


@pytest.mark.settings(park_after_seconds=1, presence_interval_seconds=0)
async def test_the_admin_queue_view_has_the_same_fields(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent, _, registration = await consumer_of(backend)
    subscription = await agent.create_subscription()
    _, legacy_offering = await backend.agent_with_offering()
    await backend.grant(agent, legacy_offering)
    created = await agent.create_queue(subscription["uuid"], legacy_offering)
    assert created.status_code == 201, created.text
    legacy = created.json()["queue_name"]
    assert await management.delete_queue(agent.vhost, legacy)
    await status(client, registration["rmq_username"], agent.headers)  # first sight
    await asyncio.sleep(1.2)
    response = await client.get(
        "/api/admin/queues/", params={"vhost": agent.vhost}, headers=SERVICE
    )
    assert response.status_code == 200, response.text
    rows = {row["queue_name"]: row for row in response.json()}
    consumer_row, legacy_row = rows[registration["queue_name"]], rows[legacy]
    assert reason(consumer_row) == "agent_away"
    assert consumer_row["connected"] is False
    assert consumer_row["parked"] == 0
    assert consumer_row["dead_letters"] == 0
    assert reason(legacy_row) == "queue_missing"
    assert legacy_row["state"] == "missing"
    fields = await status(client, registration["rmq_username"], agent.headers)
    # `pending`, `oldest_pending_at`, `next_attempt_at`: a webhook consumer's (contract §13),
    # null for a queue, which the admin view lists only.
    webhook_only = {"pending", "oldest_pending_at", "next_attempt_at"}
    assert all(fields[name] is None for name in webhook_only)
    for name in set(fields) - {"uuid", "queue_name", "vhost"} - webhook_only:
        assert name in consumer_row, name
