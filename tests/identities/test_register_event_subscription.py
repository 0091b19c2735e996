"""register_event_subscription: agents re-register on every start; nothing may pile up."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from asgi_lifespan import LifespanManager
from sqlalchemy import func, select, update

from queuekeeper.app import create_app
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.models import EventSubscription
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend
from tests.identities.test_identities import IDENTITIES, register
from tests.stomp_client import StompConsumer

SUBSCRIPTION_FIELDS = {
    "uuid",
    "url",
    "user",
    "user_uuid",
    "user_username",
    "user_full_name",
    "created",
    "modified",
    "source_ip",
    "description",
    "observable_objects",
}


async def new_identity(agent: Agent, offering: uuid.UUID) -> str:
    response = await register(agent, offering.hex)
    assert response.status_code == 201, response.text
    identity_uuid: str = response.json()["uuid"]
    return identity_uuid


async def register_subscription(
    agent: Agent, identity_uuid: str, object_type: str = "order"
) -> httpx.Response:
    return await agent.client.post(
        f"{IDENTITIES}{identity_uuid}/register_event_subscription/",
        json={
            "observable_object_type": object_type,
            "description": "Event subscription created by the site agent for identity "
            "{identity.name}",
        },
        headers=agent.headers,
    )


async def broker_users(management: ManagementClient, settings: Settings) -> set[str]:
    users = await management.list_users()
    return {user.name for user in users if settings.instance_tag in user.tags}


async def stomp_login_works(agent: Agent, subscription_uuid: str) -> bool:
    consumer = StompConsumer(agent.vhost, subscription_uuid, agent.token)
    try:
        await asyncio.to_thread(consumer.connect)
        return bool(consumer.connection.is_connected())
    except Exception:
        return False
    finally:
        consumer.close()


async def test_restart_returns_the_same_subscription_and_creates_nothing(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity_uuid = await new_identity(agent, offering)

    first = await register_subscription(agent, identity_uuid)
    assert first.status_code == 201, first.text
    subscription = first.json()
    assert set(subscription) >= SUBSCRIPTION_FIELDS
    assert subscription["user_uuid"] == agent.uuid.hex
    assert subscription["observable_objects"] == [{"object_type": "order"}]
    assert subscription["source_ip"] == "10.1.2.3"
    queue = await agent.create_queue(subscription["uuid"], offering.hex)
    assert queue.status_code == 201
    users_before = await broker_users(management, settings)
    assert users_before == {subscription["uuid"]}

    for _restart in range(3):
        again = await register_subscription(agent, identity_uuid)
        assert again.status_code == 200, again.text
        assert again.json()["uuid"] == subscription["uuid"]
        assert (await agent.create_queue(subscription["uuid"], offering.hex)).status_code == 200

    # Another object type gets its own subscription; the first is untouched.
    other = await register_subscription(agent, identity_uuid, "resource")
    assert other.status_code == 201
    assert other.json()["uuid"] != subscription["uuid"]

    listed = await agent.client.get("/api/event-subscriptions/", headers=agent.headers)
    assert sorted(item["uuid"] for item in listed.json()) == sorted(
        [subscription["uuid"], other.json()["uuid"]]
    )
    assert await broker_users(management, settings) == users_before | {other.json()["uuid"]}
    queues = await management.list_queues_page(
        agent.vhost, page=1, page_size=100, name_prefix="subscription_"
    )
    assert [item.name for item in queues.items] == [queue.json()["queue_name"]]


async def test_reuse_resets_the_broker_password_to_the_callers_token(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity_uuid = await new_identity(agent, offering)
    subscription_uuid = (await register_subscription(agent, identity_uuid)).json()["uuid"]
    assert await stomp_login_works(agent, subscription_uuid)

    # Someone changed the broker password behind queuekeeper's back.
    await management.put_user(
        subscription_uuid,
        password_hash=rabbit_password_hash("something-else"),
        tags=[settings.instance_tag],
    )
    assert not await stomp_login_works(agent, subscription_uuid)

    response = await register_subscription(agent, identity_uuid)
    assert response.status_code == 200
    assert response.json()["uuid"] == subscription_uuid
    assert await stomp_login_works(agent, subscription_uuid)


async def _delete_user(management: ManagementClient, agent: Agent, name: str) -> None:
    assert await management.delete_user(name)


async def _delete_permissions(management: ManagementClient, agent: Agent, name: str) -> None:
    async with httpx.AsyncClient(auth=("guest", "guest")) as http:
        response = await http.delete(
            f"{BROKER.management_url}/api/permissions/{agent.vhost}/{name}"
        )
        assert response.status_code == 204


async def _mark_broken(settings: Settings, name: str) -> None:
    engine = create_engine(settings)
    async with engine.begin() as connection:
        await connection.execute(
            update(EventSubscription)
            .where(EventSubscription.uuid == uuid.UUID(name))
            .values(broker_state="broken")
        )
    await engine.dispose()


@pytest.mark.parametrize("breakage", ["user_deleted", "permissions_deleted", "marked_broken"])
async def test_a_broken_subscription_is_replaced_and_retired_with_what_it_owned(
    breakage: str, backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity_uuid = await new_identity(agent, offering)
    old = (await register_subscription(agent, identity_uuid)).json()["uuid"]
    old_queue = (await agent.create_queue(old, offering)).json()["queue_name"]
    keep = (await register_subscription(agent, identity_uuid, "resource")).json()["uuid"]

    if breakage == "user_deleted":
        await _delete_user(management, agent, old)
    elif breakage == "permissions_deleted":
        await _delete_permissions(management, agent, old)
    else:
        await _mark_broken(settings, old)

    response = await register_subscription(agent, identity_uuid)
    assert response.status_code == 201, response.text
    new = response.json()["uuid"]
    assert new != old
    assert await stomp_login_works(agent, new)

    # The broken one is gone with its queue and broker user; the other type is untouched.
    listed = await agent.client.get("/api/event-subscriptions/", headers=agent.headers)
    assert sorted(item["uuid"] for item in listed.json()) == sorted([new, keep])
    assert await management.get_queue(agent.vhost, old_queue) is None
    assert await management.get_user(old) is None
    assert await broker_users(management, settings) == {new, keep}

    # The agent's next call registers the new queue, and the following restart reuses it.
    assert (await agent.create_queue(new, offering)).status_code == 201
    again = await register_subscription(agent, identity_uuid)
    assert (again.status_code, again.json()["uuid"]) == (200, new)


async def test_concurrent_registrations_make_one_subscription(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity_uuid = await new_identity(agent, offering)
    responses = await asyncio.gather(
        *(register_subscription(agent, identity_uuid) for _ in range(4))
    )
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [200, 200, 200, 201], [r.text for r in responses]
    assert len({response.json()["uuid"] for response in responses}) == 1
    assert await broker_users(management, settings) == {responses[0].json()["uuid"]}

    engine = create_engine(settings)
    async with engine.connect() as connection:
        count = await connection.scalar(select(func.count()).select_from(EventSubscription))
    await engine.dispose()
    assert count == 1


async def test_unknown_object_type_names_the_field(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    identity_uuid = await new_identity(agent, offering)
    response = await register_subscription(agent, identity_uuid, "invoice")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "observable_object_type"
    assert "unknown object type" in response.json()["detail"]


async def test_the_types_new_in_client_813_register_and_get_a_queue(backend: Backend) -> None:
    """Every place a type is named takes 8.1.3's new values: the legacy calls too."""
    agent, offering = await backend.agent_with_offering()
    identity_uuid = await new_identity(agent, offering)
    for object_type in (
        "service_provider_project_group",
        "call",
        "proposal",
        "service_provider_account",
    ):
        response = await register_subscription(agent, identity_uuid, object_type)
        assert response.status_code == 201, response.text
        queue = await agent.create_queue(response.json()["uuid"], offering, object_type)
        assert queue.status_code == 201, queue.text
        assert queue.json()["queue_name"].endswith(f"_{object_type}")


async def test_broker_down_is_a_503_and_leaves_nothing_behind(
    settings: Settings, clean_state: None
) -> None:
    down = settings.model_copy(update={"management_url": "http://127.0.0.1:9"})
    application = create_app(down)
    async with LifespanManager(application):
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            backend = Backend(http, SERVICE_TOKEN)
            agent, offering = await backend.agent_with_offering()
            identity_uuid = await new_identity(agent, offering)
            response = await register_subscription(agent, identity_uuid)
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "7"
            assert "RabbitMQ" in response.json()["detail"]
            listed = await http.get("/api/event-subscriptions/", headers=agent.headers)
            assert listed.json() == []
