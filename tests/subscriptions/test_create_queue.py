"""create_queue: validation first, broker next, row last; idempotent; safe under races."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aio_pika
import httpx
import pytest
import respx
import structlog
from fastapi import FastAPI
from prometheus_client import REGISTRY
from sqlalchemy import delete, select

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from queuekeeper.models import EventSubscription, EventSubscriptionQueue
from queuekeeper.owners.repository import has_access
from queuekeeper.subscriptions import repository as subscription_repository
from tests.brokers import BROKER
from tests.helpers import Backend, database_statements
from tests.stomp_client import StompConsumer

EXPECTED_ARGUMENTS = {
    "x-message-ttl": 3_600_000,
    "x-max-length": 10_000,
    "x-overflow": "reject-publish-dlx",
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": "waldur.dlq.messages",
}


async def _declare_bare_queue(vhost: str, name: str, messages: int = 0) -> None:
    """What RabbitMQ does when an agent subscribes first: a queue without arguments."""
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(name, durable=True)
        for index in range(messages):
            await channel.default_exchange.publish(
                aio_pika.Message(json.dumps({"n": index}).encode()), routing_key=name
            )


async def test_repeat_answers_200_with_the_same_body(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    first = await agent.create_queue(subscription["uuid"], offering)
    again = await agent.create_queue(subscription["uuid"], offering.hex.upper())
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()


@pytest.mark.settings(relay_enabled=False, presence_events_enabled=False)  # the request's own
async def test_a_repeat_call_reads_the_database_twice(app: FastAPI, backend: Backend) -> None:
    """An agent starting again calls once per (offering, object type): one token lookup (the
    request guard's, handed to the route) and one read of what the route checks. The queue
    is found right, so nothing was declared and there is nothing to re-check."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201
    with database_statements(app.state.queuekeeper.engine, own_only=True) as statements:
        again = await agent.create_queue(subscription["uuid"], offering)
    assert again.status_code == 200
    assert len(statements) == 2, [s[:120] for s in statements]
    assert sum("users.token_hash" in s for s in statements) == 1


async def test_a_repeat_call_on_a_right_queue_only_reads_it(backend: Backend) -> None:
    """The broker is asked once (GET, the read-back contract §3 requires), not declared again:
    a declare of a queue that is already right would change nothing."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201

    before = _queue_calls()
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 200
    assert _queue_calls_since(before) == {"200": 1, "201": 0, "204": 0}


async def test_a_new_queue_is_declared_once_and_not_read_back(backend: Backend) -> None:
    """A PUT the broker answers 201 made the queue from our body: nothing to read back."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    before = _queue_calls()
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201
    assert _queue_calls_since(before) == {"200": 0, "201": 1, "204": 0}


async def test_a_queue_the_broker_kept_despite_our_declare_is_read_back_and_repaired(
    backend: Backend, management: ManagementClient
) -> None:
    """contract §3: RabbitMQ ignores an `x-` argument it does not check and answers 204 keeping
    the older queue; only the read-back sees the difference."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    await management.put_queue(
        agent.vhost, name, arguments={**EXPECTED_ARGUMENTS, "x-not-ours": "left by someone"}
    )
    with structlog.testing.capture_logs() as logs:
        response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 201, response.text
    [repaired] = [entry for entry in logs if entry["event"] == "queue_repaired"]
    assert "x-not-ours" in repaired["reason"]
    info = await management.get_queue(agent.vhost, name)
    assert info is not None
    assert info.arguments == EXPECTED_ARGUMENTS


def _queue_calls() -> dict[str, float]:
    """Management API queue calls so far by status: 200 a GET, 201/204 a PUT that created
    or found the queue."""
    return {
        status: REGISTRY.get_sample_value(
            "queuekeeper_management_api_calls_total", {"kind": "queue", "status": status}
        )
        or 0.0
        for status in ("200", "201", "204")
    }


def _queue_calls_since(before: dict[str, float]) -> dict[str, float]:
    return {status: count - before[status] for status, count in _queue_calls().items()}


async def test_a_repeat_call_repairs_a_queue_that_drifted(
    backend: Backend, management: ManagementClient
) -> None:
    """Found wrong on the read (re-created bare behind our back): declared, repaired."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = (await agent.create_queue(subscription["uuid"], offering)).json()["queue_name"]
    await management.delete_queue(agent.vhost, name)
    await _declare_bare_queue(agent.vhost, name)
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 200
    info = await management.get_queue(agent.vhost, name)
    assert info is not None
    assert info.arguments == EXPECTED_ARGUMENTS


async def test_repeat_re_creates_a_queue_deleted_behind_our_back(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    queue = (await agent.create_queue(subscription["uuid"], offering)).json()
    await management.delete_queue(agent.vhost, queue["queue_name"])
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 200
    info = await management.get_queue(agent.vhost, queue["queue_name"])
    assert info is not None
    assert info.arguments == EXPECTED_ARGUMENTS


async def test_concurrent_identical_calls_give_one_201_and_200s(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    responses = await asyncio.gather(
        *(agent.create_queue(subscription["uuid"], offering) for _ in range(5))
    )
    assert sorted(response.status_code for response in responses) == [200, 200, 200, 200, 201]
    assert len({response.json()["uuid"] for response in responses}) == 1
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert len(listed.json()) == 1


@pytest.mark.settings(relay_enabled=False, presence_events_enabled=False)  # the request's own
async def test_a_new_queue_is_four_statements(app: FastAPI, backend: Backend) -> None:
    """The token, the context read, then the new row's transaction: the advisory lock and
    the insert, which re-checks the grant itself (BEGIN and COMMIT are the driver's, not
    statements)."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    with database_statements(app.state.queuekeeper.engine, own_only=True) as statements:
        created = await agent.create_queue(subscription["uuid"], offering)
    assert created.status_code == 201
    assert len(statements) == 4, [s[:120] for s in statements]
    assert "FROM offering_access" in statements[-1]


async def test_access_revoked_while_the_queue_is_declared_waits_and_leaves_nothing(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    """The backend revokes the grant while create_queue is at the broker: revoke_access takes
    the owner's vhost lock exclusively before it touches the grant, so it waits for the
    create_queue holding it shared to commit, then removes that queue with the grant
    (docs/decisions/002-owner-lock.md). Nothing is left, whichever comes first."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    state = app.state.queuekeeper
    provisioner = state.provisioner
    declare = provisioner.ensure_queue
    revoking: list[asyncio.Task[httpx.Response]] = []

    async def declare_then_revoke(*args: Any, **kwargs: Any) -> Any:
        outcome = await declare(*args, **kwargs)
        revoking.append(
            asyncio.create_task(
                client.delete(
                    f"/api/internal/offerings/{offering}/users/{agent.uuid}/",
                    headers=backend.headers,
                )
            )
        )
        await asyncio.sleep(0.3)  # the revoke is waiting for the lock by now
        async with state.sessions() as session:
            assert await has_access(session, agent.uuid, offering)
        return outcome

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(provisioner, "ensure_queue", declare_then_revoke)
        response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 201, response.text
    assert (await revoking[0]).status_code == 204
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    assert await management.get_queue(agent.vhost, name) is None
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert listed.json() == []


async def test_a_subscription_deleted_while_the_queue_is_declared_is_a_404_and_leaves_nothing(
    app: FastAPI, backend: Backend, management: ManagementClient
) -> None:
    """The subscription's row goes while create_queue is at the broker: the insert fails its
    foreign key, the transaction is rolled back, and the queue just declared is deleted."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    state = app.state.queuekeeper
    provisioner = state.provisioner
    declare = provisioner.ensure_queue

    async def declare_then_delete(*args: Any, **kwargs: Any) -> Any:
        outcome = await declare(*args, **kwargs)
        async with state.sessions() as session:
            await session.execute(
                delete(EventSubscription).where(
                    EventSubscription.uuid == uuid.UUID(subscription["uuid"])
                )
            )
            await session.commit()
        return outcome

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(provisioner, "ensure_queue", declare_then_delete)
        response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 404, response.text
    assert "deleted while the queue was being created" in response.json()["detail"]
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    assert await management.get_queue(agent.vhost, name) is None
    async with state.sessions() as session:
        rows = await session.scalars(
            select(EventSubscriptionQueue).where(EventSubscriptionQueue.queue_name == name)
        )
        assert rows.all() == []


async def test_a_revoke_after_the_insert_waits_for_the_commit_and_then_takes_the_queue(
    app: FastAPI,
    settings: Settings,
    client: httpx.AsyncClient,
    backend: Backend,
    management: ManagementClient,
) -> None:
    """The insert locks the grant (FOR SHARE) until the commit; revoke_access locks it too
    before it lists the queues to delete, so it waits, then sees the new row and removes it
    with its queue."""
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    insert = subscription_repository.insert_queue_with_access
    revoking: list[asyncio.Task[httpx.Response]] = []

    async def insert_then_revoke(*args: Any) -> Any:
        inserted = await insert(*args)
        revoke = asyncio.create_task(
            client.delete(
                f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=backend.headers
            )
        )
        revoking.append(revoke)
        await asyncio.sleep(0.5)
        assert not revoke.done(), "the revoke did not wait for the locked grant"
        return inserted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subscription_repository, "insert_queue_with_access", insert_then_revoke)
        response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 201, response.text
    assert (await revoking[0]).status_code == 204
    assert await management.get_queue(agent.vhost, response.json()["queue_name"]) is None
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert listed.json() == []


async def test_queue_auto_created_without_arguments_is_repaired(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    await _declare_bare_queue(agent.vhost, name)

    with structlog.testing.capture_logs() as logs:
        response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 201, response.text
    info = await management.get_queue(agent.vhost, name)
    assert info is not None
    assert info.arguments == EXPECTED_ARGUMENTS
    repaired = [entry for entry in logs if entry["event"] == "queue_repaired"]
    assert repaired
    assert "inequivalent arg" in repaired[0]["reason"]


async def test_queue_with_other_arguments_and_messages_is_a_409(
    backend: Backend, management: ManagementClient, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    await _declare_bare_queue(agent.vhost, name, messages=2)

    response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 409
    body = response.json()
    assert "inequivalent arg" in body["detail"]
    assert body["queue_name"] == name
    assert "Drain it" in body["action"]
    info = await management.get_queue(agent.vhost, name)
    assert info is not None
    assert info.arguments == {}  # left alone: it holds messages
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert listed.json() == []  # and no row


async def test_queue_with_other_arguments_and_a_consumer_is_a_409(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    await _declare_bare_queue(agent.vhost, name)
    consumer = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{name}")
        await asyncio.sleep(0.3)
        response = await agent.create_queue(subscription["uuid"], offering)
        assert response.status_code == 409
        assert "in use" in response.json()["detail"] or "consumer" in response.json()["detail"]
    finally:
        consumer.close()


async def test_broker_unreachable_is_a_503_and_leaves_no_row(
    backend: Backend, make_client: object, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    dead = await make_client(management_url="http://127.0.0.1:9")  # type: ignore[operator]
    response = await dead.post(
        f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
        json={"offering_uuid": offering.hex, "object_type": "order"},
        headers=agent.headers,
    )
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "7"
    assert "RabbitMQ is unavailable" in response.json()["detail"]
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert listed.json() == []


@pytest.mark.parametrize(
    "failure",
    [
        httpx.Response(503, json={"error": "boom", "reason": "node down"}),
        httpx.Response(500, text="<html>proxy error</html>"),
        httpx.ReadTimeout("timed out"),
    ],
    ids=["503", "500-not-json", "timeout"],
)
async def test_management_failures_are_503(
    backend: Backend, client: httpx.AsyncClient, settings: Settings, failure: object
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    with respx.mock(assert_all_called=False) as mock:
        mock.route(url__startswith=settings.management_url).mock(side_effect=[failure, failure])
        mock.route().pass_through()
        response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "7"
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert listed.json() == []


async def test_bad_bodies_are_400s_naming_the_field(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    cases = [
        (
            {"offering_uuid": offering.hex, "object_type": "orders"},
            "object_type",
            "unknown object type",
        ),
        ({"offering_uuid": "xyz", "object_type": "order"}, "offering_uuid", "UUID"),
        ({"object_type": "order"}, "offering_uuid", "required"),
        (
            {"offering_uuid": uuid.uuid4().hex, "object_type": "order"},
            "offering_uuid",
            "Unknown offering",
        ),
    ]
    for body, field, words in cases:
        response = await agent.client.post(
            f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
            json=body,
            headers=agent.headers,
        )
        assert response.status_code == 400, (body, response.text)
        assert response.json()["errors"][0]["field"] == field
        assert words.lower() in response.json()["detail"].lower()
    response = await agent.client.post(
        f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
        content=b"{not json",
        headers={**agent.headers, "content-type": "application/json"},
    )
    assert response.status_code == 400


async def test_access_and_ownership(backend: Backend, management: ManagementClient) -> None:
    agent, _offering = await backend.agent_with_offering()
    foreign_offering = await backend.put_offering()
    subscription = await agent.create_subscription()
    response = await agent.create_queue(subscription["uuid"], foreign_offering)
    assert response.status_code == 403
    assert foreign_offering.hex in response.json()["detail"]
    # Nothing reached the broker for the refused call.
    name = f"subscription_{subscription['uuid']}_offering_{foreign_offering.hex}_order"
    assert await management.get_queue(agent.vhost, name) is None

    other, other_offering = await backend.agent_with_offering()
    response = await other.create_queue(subscription["uuid"], other_offering)
    assert response.status_code == 404
    response = await agent.create_queue("not-a-uuid", foreign_offering)
    assert response.status_code == 404


async def test_unobserved_type_may_be_registered_and_names_are_lowercase_hex(
    backend: Backend,
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription(observable_objects=[{"object_type": "order"}])
    dashed_upper = str(offering).upper()
    response = await agent.create_queue(subscription["uuid"].upper(), dashed_upper, "resource")
    assert response.status_code == 201
    assert response.json()["queue_name"] == (
        f"subscription_{subscription['uuid']}_offering_{offering.hex}_resource"
    )
    assert response.json()["offering_uuid"] == offering.hex


async def test_concurrent_calls_repairing_the_same_queue_all_succeed(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    await _declare_bare_queue(agent.vhost, name)
    responses = await asyncio.gather(
        *(agent.create_queue(subscription["uuid"], offering) for _ in range(4))
    )
    assert sorted(response.status_code for response in responses) == [200, 200, 200, 201], [
        response.text for response in responses
    ]
    info = await management.get_queue(agent.vhost, name)
    assert info is not None
    assert info.arguments == EXPECTED_ARGUMENTS
