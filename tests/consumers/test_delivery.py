"""Delivery to consumers (contract §9): one copy per matching consumer, filtered by type, owner
access re-checked, `user_uuids` honoured, legacy copies suppressed for the consumer's owner."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.events.relay import Relay
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.events.support import (
    drain,
    event_detail,
    order_event,
    post_batch,
    post_event,
    queue_depth,
    register,
)
from tests.helpers import Agent, Backend, database_statements


async def consumer_for(agent: Agent, offering: uuid.UUID, types: list[str] | None = None) -> str:
    identity = await new_identity(agent, offering)
    body = {"object_types": types} if types is not None else {}
    response = await register_queue(agent, identity, body)
    assert response.status_code == 201, response.text
    name: str = response.json()["queue_name"]
    return name


def resource_event(offering: uuid.UUID, **extra: Any) -> dict[str, Any]:
    return {
        "offering_uuid": offering.hex,
        "object_type": "resource",
        "payload": {"resource_uuid": uuid.uuid4().hex},
        **extra,
    }


async def test_a_consumer_receives_its_types_with_object_type_and_schema_version(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    queue = await consumer_for(agent, offering, ["order"])
    order = order_event(offering, event_id="to-consumer")
    answer = await post_event(client, order, wait=True)
    assert answer.status_code == 200, answer.text
    assert answer.json()["queued"] == 1
    assert answer.json()["deliveries"] == [
        {"queue_name": queue, "vhost": agent.vhost, "state": "published"}
    ]
    # Outside its filter: nothing, and nothing counted as skipped.
    other = await post_event(client, resource_event(offering))
    assert (other.json()["queued"], other.json()["skipped_unregistered"]) == (0, 0)

    (message,) = await drain(agent.vhost, queue)
    assert json.loads(message.body) == {
        **order["payload"],
        "offering_uuid": offering.hex,
        "object_type": "order",
        "schema_version": 1,
    }
    assert message.message_id == "to-consumer"
    assert message.type == "order"
    assert message.headers["object_type"] == "order"
    detail = await event_detail(client, "to-consumer")
    assert [(d["queue_name"], d["state"]) for d in detail["deliveries"]] == [(queue, "published")]


async def test_owner_access_user_uuids_and_suppression(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    legacy = await register(backend, agent=agent, offering=offering)  # the same user, 1.0.5
    consumer = await consumer_for(agent, offering)
    other = await register(backend, offering=offering)  # another user, legacy only

    def copies(answer: httpx.Response) -> list[str]:
        return sorted(d["queue_name"] for d in answer.json()["deliveries"])

    both = await post_event(client, order_event(offering), wait=True)
    # The user served by its consumer gets no legacy copy; the other user keeps its own.
    assert copies(both) == sorted([consumer, other.queue_name])
    assert await queue_depth(agent.vhost, legacy.queue_name) == 0

    narrowed = await post_event(
        client, order_event(offering, user_uuids=[other.agent.uuid.hex]), wait=True
    )
    assert copies(narrowed) == [other.queue_name]
    mine = await post_event(client, order_event(offering, user_uuids=[agent.uuid.hex]), wait=True)
    assert copies(mine) == [consumer]

    # The owner deactivated: the consumer and its legacy queues get nothing.
    await backend.put_user(agent.uuid, is_active=False)
    inactive = await post_event(client, order_event(offering), wait=True)
    assert copies(inactive) == [other.queue_name]


async def test_a_consumer_bound_to_another_offering_gets_nothing(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    await consumer_for(agent, offering)
    elsewhere = await backend.put_offering()
    await backend.grant(agent, elsewhere)
    answer = await post_event(client, order_event(elsewhere))
    assert answer.json()["queued"] == 0


@pytest.mark.settings(relay_poll_interval=60.0)
async def test_consumer_copies_handed_to_the_relay_each_publish_once_without_a_claim(
    app: Any, client: httpx.AsyncClient, backend: Backend
) -> None:
    # The copies of one event are written claimed and handed over in memory; two consumers'
    # copies share the event and have no subscription queue, yet each keeps its own row.
    agent, offering = await backend.agent_with_offering()
    second = await backend.put_user()
    await backend.grant(second, offering)
    mine, theirs = await consumer_for(agent, offering), await consumer_for(second, offering)
    legacy = await register(backend, offering=offering)
    relay = app.state.queuekeeper.relay
    real_claim = relay.claim
    claims = 0

    async def counting_claim() -> list[Any]:
        nonlocal claims
        claims += 1
        return await real_claim()

    relay.claim = counting_claim
    answer = await post_event(client, order_event(offering, event_id="handed"), wait=True)
    assert answer.status_code == 200, answer.text
    assert sorted((d["queue_name"], d["state"]) for d in answer.json()["deliveries"]) == sorted(
        [(mine, "published"), (theirs, "published"), (legacy.queue_name, "published")]
    )
    assert claims == 0
    detail = await event_detail(client, "handed")
    assert [d["attempts"] for d in detail["deliveries"]] == [1, 1, 1]
    assert await queue_depth(agent.vhost, mine) == 1
    assert await queue_depth(second.vhost, theirs) == 1


@pytest.mark.settings(relay_enabled=False)
async def test_a_copy_whose_consumer_was_deleted_is_given_up(
    app: Any, client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    await consumer_for(agent, offering)
    accepted = await post_event(client, order_event(offering, event_id="orphaned"))
    assert accepted.json()["queued"] == 1
    listed = (await client.get("/api/event-consumers/", headers=agent.headers)).json()
    deleted = await client.delete(
        f"/api/event-consumers/{listed[0]['uuid']}/", headers=agent.headers
    )
    assert deleted.status_code == 204
    state = app.state.queuekeeper
    relay = Relay(state.settings, state.engine, AmqpPublisher(state.settings), state.provisioner)
    try:
        assert await relay.run_once() == 1
    finally:
        await relay.publisher.close()
    detail = await event_detail(client, "orphaned")
    assert detail["deliveries"][0]["state"] == "given_up"
    assert "consumer" in detail["deliveries"][0]["last_error"]


@pytest.mark.settings(relay_enabled=False)
async def test_recipients_stay_three_statements_with_consumers(
    app: Any, client: httpx.AsyncClient, backend: Backend
) -> None:
    small, small_offering = await backend.agent_with_offering()
    await consumer_for(small, small_offering)
    large = await backend.put_offering()
    for _ in range(5):
        agent = await backend.put_user()
        await backend.grant(agent, large)
        await consumer_for(agent, large, ["order"])
        await register(backend, agent=agent, offering=large)  # suppressed for orders

    def batch(offering: uuid.UUID) -> list[dict[str, Any]]:
        return [order_event(offering) for _ in range(10)] + [resource_event(offering)]

    with database_statements(app.state.queuekeeper.engine, own_only=True) as statements:
        statements.clear()
        assert (await post_batch(client, batch(small_offering))).status_code == 202
        few = len(statements)
        statements.clear()
        response = await post_batch(client, batch(large) + batch(small_offering))
        many = len(statements)
    answers = response.json()["events"]
    assert [a["queued"] for a in answers[:11]] == [5] * 10 + [0]
    assert [a["queued"] for a in answers[11:]] == [1] * 11
    # The recipients, then the write: one statement.
    assert many == few == 2, [s[:120] for s in statements]


async def test_metrics_count_consumers_and_copies_by_kind(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    registrations = ("queuekeeper_consumer_registrations_total",)
    created_before = sample(*registrations, route="register_queue", outcome="created")
    agent, offering = await backend.agent_with_offering()
    await consumer_for(agent, offering)
    await register(backend, offering=offering)  # a legacy queue of another user
    assert sample(*registrations, route="register_queue", outcome="created") == created_before + 1

    copies = "queuekeeper_copies_total"
    before = {
        (kind, stage): sample(copies, kind=kind, stage=stage)
        for kind in ("legacy", "consumer")
        for stage in ("queued", "published")
    }
    answer = await post_event(client, order_event(offering), wait=True)
    assert answer.json()["queued"] == 2
    for kind in ("legacy", "consumer"):
        for stage in ("queued", "published"):
            assert sample(copies, kind=kind, stage=stage) == before[(kind, stage)] + 1


@pytest.mark.settings(queue_type="quorum")
async def test_a_consumer_queue_follows_the_queue_type(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    queue = await consumer_for(agent, offering)
    info = await management.get_queue(agent.vhost, queue, columns="name,type,arguments")
    assert info is not None
    assert info.type == "quorum"
    assert info.arguments["x-overflow"] == "reject-publish"
    answer = await post_event(client, order_event(offering), wait=True)
    assert [d["state"] for d in answer.json()["deliveries"]] == ["published"]
    assert len(await drain(agent.vhost, queue)) == 1
