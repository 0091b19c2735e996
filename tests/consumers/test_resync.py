"""Resync (contract §13): every active role grant within a consumer's bindings, sent once
to that consumer alone as a `role_snapshot` `user_role` message through its own path."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from queuekeeper.app import Runtime
from queuekeeper.models import Delivery, Event, utcnow
from tests.consumers.scopes import SERVICE, role, scopes, staff, tree
from tests.consumers.test_event_consumers_api import CONSUMERS, register
from tests.helpers import Agent, Backend
from tests.stomp_client import StompConsumer
from tests.webhooks.test_registration import URL, register_webhook


async def consumer_of(agent: Agent, body: dict[str, Any]) -> dict[str, Any]:
    made = await register(agent, body)
    assert made.status_code in (200, 201), made.text
    answer: dict[str, Any] = made.json()
    return answer


async def resync(
    client: httpx.AsyncClient, consumer: str, headers: dict[str, str]
) -> httpx.Response:
    return await client.post(f"{CONSUMERS}{consumer}/resync/", headers=headers)


async def received(owner: Agent, consumer: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The `count` messages a real STOMP client reads from the consumer's queue, and no more
    within a moment."""
    reader = StompConsumer(owner.vhost, consumer["rmq_username"], owner.token)
    await asyncio.to_thread(reader.connect)
    try:
        reader.subscribe(f"/amq/queue/{consumer['queue_name']}")
        await asyncio.to_thread(reader.wait_for, count, 15.0)
        await asyncio.sleep(1.0)
        messages = list(reader.listener.messages)
    finally:
        await asyncio.to_thread(reader.close)
    assert len(messages) == count
    for message in messages:
        assert message.headers["amqp-message-id"].startswith("resync:")
    return [json.loads(message.body) for message in messages]


async def test_a_global_consumer_gets_every_active_grant(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    place = await tree(client)
    alice, bob = await backend.put_user(), await backend.put_user()
    await role(client, alice, "project", place.project)
    await role(client, bob, "customer", place.customer)
    await role(client, bob, "project", place.project, expires_at=utcnow() - timedelta(hours=1))
    admin = await staff(backend)
    everything = await consumer_of(admin, {"scopes": []})

    started = await resync(client, everything["rmq_username"], SERVICE)
    assert started.status_code == 202, started.text
    # Two snapshots queued: alice's project role and bob's customer role (not his expired one).
    assert started.json() == {"object_types": ["user_role"], "copies": 2}
    bodies = await received(admin, everything, 2)
    by_role = {uuid.UUID(hex=body["scope_uuid"]): body for body in bodies}
    assert set(by_role) == {place.project, place.customer}
    snapshot = by_role[place.project]
    assert snapshot["event_type"] == "role_snapshot"
    assert snapshot["object_type"] == "user_role"
    assert snapshot["user_uuid"] == alice.uuid.hex
    assert snapshot["user_username"] == f"user-{alice.uuid.hex[:8]}"
    assert (snapshot["role_name"], snapshot["scope_type"], snapshot["expires_at"]) == (
        "project.member",
        "project",
        None,
    )
    assert by_role[place.customer]["user_uuid"] == bob.uuid.hex
    assert by_role[place.customer]["scope_type"] == "customer"

    # A second resync sends them again, under new message ids.
    again = await resync(client, everything["rmq_username"], admin.headers)
    assert again.status_code == 202
    assert len(await received(admin, everything, 2)) == 2


async def test_a_project_bound_consumer_gets_the_grants_within_its_binding_only(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    mine, other = await tree(client), await tree(client)
    member, outsider = await backend.put_user(), await backend.put_user()
    await role(client, member, "project", mine.project)
    await role(client, member, "offering", mine.offering)  # the offering is in the project
    await role(client, outsider, "project", other.project)
    await role(client, outsider, "customer", mine.customer)  # above the binding: not a key
    admin = await staff(backend)
    bound = await consumer_of(admin, {"scopes": scopes(("project", mine.project))})
    # Another consumer of the same owner gets nothing from this resync.
    bystander = await consumer_of(admin, {"scopes": []})

    started = await resync(client, bound["rmq_username"], SERVICE)
    assert started.status_code == 202
    bodies = await received(admin, bound, 2)
    assert {(b["scope_type"], b["scope_uuid"]) for b in bodies} == {
        ("project", mine.project.hex),
        ("offering", mine.offering.hex),
    }
    assert {b["user_uuid"] for b in bodies} == {member.uuid.hex}
    assert await received(admin, bystander, 0) == []


async def test_resync_follows_the_filters(backend: Backend, client: httpx.AsyncClient) -> None:
    place = await tree(client)
    user = await backend.put_user()
    await role(client, user, "project", place.project)
    await role(client, user, "customer", place.customer)
    admin = await staff(backend)
    customers_only = await consumer_of(
        admin, {"scopes": [], "payload_filters": {"scope_type": ["customer"]}}
    )
    assert (await resync(client, customers_only["rmq_username"], SERVICE)).status_code == 202
    (only,) = await received(admin, customers_only, 1)
    assert only["scope_type"] == "customer"
    orders_only = await consumer_of(
        admin, {"scopes": scopes(("customer", place.customer)), "object_types": ["order"]}
    )
    assert (await resync(client, orders_only["rmq_username"], SERVICE)).status_code == 202
    assert await received(admin, orders_only, 0) == []


async def test_who_may_resync(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering = await backend.agent_with_offering()
    own = await consumer_of(agent, {"scopes": scopes(("offering", offering))})
    refused = await resync(client, own["rmq_username"], agent.headers)
    assert refused.status_code == 403
    assert "staff" in refused.json()["detail"]
    unknown = await resync(client, uuid.uuid4().hex, SERVICE)
    assert unknown.status_code == 404
    admin = await staff(backend)
    # A staff user's own consumers only; the service token's every one.
    assert (await resync(client, own["rmq_username"], admin.headers)).status_code == 404
    assert (await resync(client, own["rmq_username"], SERVICE)).status_code == 202


# No relay: nothing else touches the copies (the webhook dispatcher is not this test's).
@pytest.mark.settings(webhook_allowed_networks=["127.0.0.0/8"], relay_enabled=False)
async def test_a_webhook_consumers_resync_copies_wait_for_its_receiver(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    place = await tree(client)
    user = await backend.put_user()
    await role(client, user, "project", place.project)
    await role(client, user, "customer", place.customer)
    admin = await staff(backend)
    hook = (await register_webhook(admin, {"webhook_url": URL})).json()
    before = utcnow()
    assert (await resync(client, hook["uuid"], SERVICE)).status_code == 202
    state: Runtime = app.state.queuekeeper
    async with state.sessions() as session:
        copies = list(
            await session.scalars(
                select(Delivery).where(Delivery.consumer_uuid == uuid.UUID(hook["uuid"]))
            )
        )
    assert len(copies) == 2
    assert all(copy.webhook and copy.state == "pending" for copy in copies)
    status = (await client.get(f"{CONSUMERS}{hook['uuid']}/status/", headers=SERVICE)).json()
    assert status["pending"] == 2
    assert status["oldest_pending_at"] is not None
    assert status["next_attempt_at"] is not None
    assert before.isoformat() <= status["oldest_pending_at"].replace("Z", "+00:00")

    # Deleting the consumer gives its copies up.
    gone = await client.delete(f"{CONSUMERS}{hook['uuid']}/", headers=SERVICE)
    assert gone.status_code == 204
    async with state.sessions() as session:
        states = list(
            await session.scalars(
                select(Delivery.state).where(Delivery.id.in_([c.id for c in copies]))
            )
        )
    assert states == ["given_up", "given_up"]


@pytest.mark.settings(webhook_allowed_networks=["127.0.0.0/8"], relay_enabled=False)
async def test_narrowing_a_webhook_consumers_bindings_gives_up_what_they_no_longer_allow(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    kept, dropped = await tree(client), await tree(client)
    user = await backend.put_user()
    await role(client, user, "project", kept.project)
    await role(client, user, "project", dropped.project)
    admin = await staff(backend)
    both = scopes(("project", kept.project), ("project", dropped.project))
    hook = (await register_webhook(admin, {"webhook_url": URL, "scopes": both})).json()
    assert (await resync(client, hook["uuid"], SERVICE)).status_code == 202

    narrowed = await client.post(
        f"{CONSUMERS}{hook['uuid']}/update_webhook/",
        json={"scopes": scopes(("project", kept.project))},
        headers=admin.headers,
    )
    assert narrowed.status_code == 200, narrowed.text
    state: Runtime = app.state.queuekeeper
    async with state.sessions() as session:
        rows = await session.execute(
            select(Delivery.state, Delivery.last_error, Event.project_uuid)
            .join(Event, Event.event_id == Delivery.event_id)
            .where(Delivery.consumer_uuid == uuid.UUID(hook["uuid"]))
        )
        found = {project: (state_, error) for state_, error, project in rows}
    assert found[kept.project] == ("pending", None)
    assert found[dropped.project] == ("given_up", "the consumer's bindings no longer allow it")
    status = (await client.get(f"{CONSUMERS}{hook['uuid']}/status/", headers=SERVICE)).json()
    assert status["pending"] == 1


@pytest.mark.settings(webhook_allowed_networks=["127.0.0.0/8"], relay_enabled=False)
async def test_a_webhook_consumer_going_with_its_offering_or_owner_gives_its_copies_up(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    place = await tree(client)
    user = await backend.put_user()
    await role(client, user, "offering", place.offering)
    admin = await staff(backend)
    with_offering = (
        await register_webhook(
            admin, {"webhook_url": URL, "scopes": scopes(("offering", place.offering))}
        )
    ).json()
    other_admin = await staff(backend)
    with_owner = (await register_webhook(other_admin, {"webhook_url": URL})).json()
    for hook in (with_offering, with_owner):
        assert (await resync(client, hook["uuid"], SERVICE)).status_code == 202

    gone = await client.delete(f"/api/internal/offerings/{place.offering}/", headers=SERVICE)
    assert gone.status_code == 204
    removed = await client.delete(f"/api/internal/users/{other_admin.uuid}/", headers=SERVICE)
    assert removed.status_code == 204
    state: Runtime = app.state.queuekeeper
    async with state.sessions() as session:
        rows = await session.execute(
            select(Delivery.state, Delivery.last_error, Delivery.consumer_uuid).where(
                Delivery.queue_name.in_([with_offering["queue_name"], with_owner["queue_name"]])
            )
        )
        found = sorted((state_, error, consumer) for state_, error, consumer in rows)
    # The one role grant, once to each consumer; both given up when their consumer went.
    assert found == [("given_up", "the consumer was deleted", None)] * 2
