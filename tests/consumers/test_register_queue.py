"""register_queue (contract §9): what waldur-site-agent 1.0.7 calls once per offering on
every start."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.events.payloads import OBJECT_TYPES
from queuekeeper.models import EventConsumer
from tests.agents.harness import AGENT_107_TYPES
from tests.helpers import Agent, Backend
from tests.identities.test_identities import IDENTITIES, register
from tests.stomp_client import StompConsumer

QUEUE_ARGUMENTS = {
    "x-message-ttl": 3600000,
    "x-max-length": 10000,
    "x-overflow": "reject-publish-dlx",
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": "waldur.dlq.messages",
}
# waldur-api-client 8.1.3's ObservableObjectTypeEnum (18 values; 8.1.2's 14 are among them).
CLIENT_813_ENUM = sorted(
    [
        *AGENT_107_TYPES,
        "resource_end_date_change_request",
        "user_lifecycle",
        "user_profile",
        "user_ssh_key",
        "call",
        "proposal",
        "service_provider_account",
        "service_provider_project_group",
    ]
)


async def new_identity(agent: Agent, offering: uuid.UUID, **overrides: Any) -> str:
    response = await register(agent, offering.hex, version="1.0.7", **overrides)
    assert response.status_code == 201, response.text
    identity: str = response.json()["uuid"]
    return identity


async def register_queue(agent: Agent, identity: str, body: Any = None) -> httpx.Response:
    return await agent.client.post(
        f"{IDENTITIES}{identity}/register_queue/",
        json={"object_types": AGENT_107_TYPES} if body is None else body,
        headers=agent.headers,
    )


async def consumer_rows(settings: Settings) -> int:
    engine = create_engine(settings)
    try:
        async with engine.connect() as connection:
            return int(await connection.scalar(select(func.count()).select_from(EventConsumer)))
    finally:
        await engine.dispose()


async def broker_view(management: ManagementClient, vhost: str, user: str) -> dict[str, Any]:
    queues = await management.list_queues_page(vhost, page=1, page_size=100)
    found = await management.get_user(user)
    permissions = await management.get_permissions(vhost, user)
    return {
        "queues": sorted(
            (item.name, tuple(sorted(item.arguments.items()))) for item in queues.items
        ),
        "user": found.password_hash if found else None,
        "permissions": permissions.permissions.as_body() if permissions else None,
    }


def test_the_filter_accepts_every_type_of_the_client_enum() -> None:
    assert sorted(OBJECT_TYPES) == CLIENT_813_ENUM


async def test_first_start_makes_the_queue_and_user_a_restart_changes_nothing(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering, last_restarted="2026-11-23T00:51:07+00:00")

    first = await register_queue(agent, identity)
    assert first.status_code == 201, first.text
    answer = first.json()
    assert set(answer) == {"rmq_username", "queue_name", "vhost", "observable_object_types"}
    assert answer["vhost"] == agent.vhost
    assert answer["queue_name"] == f"consumer_{answer['rmq_username']}"
    assert len(answer["rmq_username"]) == 32
    assert answer["observable_object_types"] == AGENT_107_TYPES

    # The broker side is real before the answer: queue (arguments read back), user, rights.
    queue = await management.get_queue(agent.vhost, answer["queue_name"])
    assert queue is not None
    assert queue.arguments == QUEUE_ARGUMENTS
    assert queue.durable is True
    assert queue.auto_delete is False
    user = await management.get_user(answer["rmq_username"])
    assert user is not None
    assert settings.instance_tag in user.tags
    permissions = await management.get_permissions(agent.vhost, answer["rmq_username"])
    assert permissions is not None
    assert (permissions.configure, permissions.write, permissions.read) == (
        "^$",
        "^$",
        f"^{answer['queue_name']}$",
    )
    assert await management.get_queue(agent.vhost, "waldur.dlq.messages") is not None
    before = await broker_view(management, agent.vhost, answer["rmq_username"])

    # A restart: PUT the identity (1.0.7 sends an aware UTC time), register again.
    restarted = await agent.client.put(
        f"{IDENTITIES}{identity}/",
        json={
            "offering": offering.hex,
            "name": f"agent-{offering.hex}",
            "version": "1.0.7",
            "last_restarted": "2026-11-23T01:00:00.123456+00:00",
        },
        headers=agent.headers,
    )
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["last_restarted"] == "2026-11-23T01:00:00.123456Z"
    again = await register_queue(agent, identity)
    assert again.status_code == 200, again.text
    assert again.json() == answer
    assert await broker_view(management, agent.vhost, answer["rmq_username"]) == before
    assert await consumer_rows(settings) == 1


async def test_a_restart_re_creates_a_queue_deleted_behind_our_back(
    backend: Backend, management: ManagementClient
) -> None:
    """A restart reads the queue first; one that is gone is declared again, as contract §3 asks."""
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    name = (await register_queue(agent, identity)).json()["queue_name"]
    await management.delete_queue(agent.vhost, name)
    assert (await register_queue(agent, identity)).status_code == 200
    queue = await management.get_queue(agent.vhost, name)
    assert queue is not None
    assert queue.arguments == QUEUE_ARGUMENTS


async def test_the_password_is_the_callers_current_token_on_every_call(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    name = (await register_queue(agent, identity)).json()["rmq_username"]
    # Drifted by hand: the next start puts the token back.
    await management.put_user(name, password_hash="", tags=[])
    assert (await register_queue(agent, identity)).status_code == 200
    user = await management.get_user(name)
    assert user is not None
    assert user.password_hash != ""
    consumer = StompConsumer(agent.vhost, name, agent.token)
    await asyncio.to_thread(consumer.connect)
    consumer.close()
    # Rotated by the backend: the consumer's broker password follows at once.
    rotated = await backend.put_user(agent.uuid, token="rotated-token-" + uuid.uuid4().hex)
    after = await management.get_user(name)
    assert after is not None
    assert after.password_hash != user.password_hash
    consumer = StompConsumer(agent.vhost, name, rotated.token)
    await asyncio.to_thread(consumer.connect)
    consumer.close()
    assert rabbit_password_hash  # the format is RabbitMQ's own (checked in broker tests)


async def test_filter_omitted_keeps_empty_means_all_list_replaces(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)

    first = await register_queue(agent, identity, {})
    assert first.status_code == 201
    assert sorted(first.json()["observable_object_types"]) == CLIENT_813_ENUM
    narrowed = await register_queue(agent, identity, {"object_types": ["order", "resource"]})
    assert narrowed.json()["observable_object_types"] == ["order", "resource"]
    kept = await register_queue(agent, identity, {})
    assert kept.json()["observable_object_types"] == ["order", "resource"]
    kept = await register_queue(agent, identity, {"object_types": None})
    assert kept.json()["observable_object_types"] == ["order", "resource"]
    everything = await register_queue(agent, identity, {"object_types": []})
    assert sorted(everything.json()["observable_object_types"]) == CLIENT_813_ENUM
    # The same queue throughout.
    assert len({r.json()["queue_name"] for r in (first, narrowed, kept, everything)}) == 1


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"object_types": ["order", "orders"]}, "object_types.1", "unknown object type"),
        ({"object_types": ["order", "order"]}, "object_types", "listed twice"),
        ({"object_types": "order"}, "object_types", "list"),
        (["order"], "body", "must be a JSON object"),
    ],
    ids=["unknown", "duplicate", "not-a-list", "not-an-object"],
)
async def test_a_bad_body_is_a_400_naming_the_field_and_makes_nothing(
    backend: Backend, settings: Settings, body: Any, field: str, words: str
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    response = await register_queue(agent, identity, body)
    assert response.status_code == 400, response.text
    error = response.json()["errors"][0]
    assert error["field"] == field
    assert words in error["message"]
    assert await consumer_rows(settings) == 0


async def test_who_may_register(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)

    unknown = await register_queue(agent, uuid.uuid4().hex)
    assert unknown.status_code == 404
    assert "not found" in unknown.json()["detail"]
    assert (await register_queue(agent, "not-a-uuid")).status_code == 404

    other = await backend.put_user(username="someone-else")
    await backend.grant(other, offering)
    taken = await register_queue(other, identity)
    assert taken.status_code == 409
    assert "'someone-else'" not in taken.json()["detail"]
    owner_name = (await client.get("/api/users/me/", headers=agent.headers)).json()["username"]
    assert repr(owner_name) in taken.json()["detail"]

    response = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=backend.headers
    )
    assert response.status_code == 204
    refused = await register_queue(agent, identity)
    assert refused.status_code == 403
    assert offering.hex in refused.json()["detail"]

    await backend.grant(agent, offering)
    assert (await register_queue(agent, identity)).status_code == 201

    # The offering deleted: the identity went with it, and the answer says so.
    response = await client.delete(f"/api/internal/offerings/{offering}/", headers=backend.headers)
    assert response.status_code == 204
    gone = await register_queue(agent, identity)
    assert gone.status_code == 404
    assert "offering was deleted" in gone.json()["detail"]


async def test_an_unknown_path_with_its_slash_is_not_told_to_add_one(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(f"{IDENTITIES}{uuid.uuid4().hex}/register_queues/")
    assert response.status_code == 404
    assert "end with a slash" not in response.json()["detail"]
    response = await client.post(f"{IDENTITIES}{uuid.uuid4().hex}/register_queue")
    assert response.status_code == 404
    assert "register_queue/ ?" in response.json()["detail"]


async def test_broker_unreachable_is_a_503_and_nothing_is_left(
    backend: Backend,
    make_client: Any,
    settings: Settings,
    management: ManagementClient,
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    dead = await make_client(management_url="http://127.0.0.1:9")
    response = await dead.post(
        f"{IDENTITIES}{identity}/register_queue/",
        json={"object_types": ["order"]},
        headers=agent.headers,
    )
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
    assert await consumer_rows(settings) == 0
    assert await management.get_vhost(agent.vhost) is None


async def test_concurrent_first_registrations_end_with_one_consumer(
    backend: Backend, settings: Settings, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    answers = await asyncio.gather(*(register_queue(agent, identity) for _ in range(4)))
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 201], [a.text for a in answers]
    assert len({a.json()["queue_name"] for a in answers}) == 1
    assert await consumer_rows(settings) == 1
    queues = await management.list_queues_page(agent.vhost, page=1, page_size=100)
    assert [q.name for q in queues.items if q.name.startswith("consumer_")] == [
        answers[0].json()["queue_name"]
    ]
    ours = {u.name for u in await management.list_users() if settings.instance_tag in u.tags}
    assert ours == {answers[0].json()["rmq_username"]}


async def test_consumer_credentials_read_their_queue_and_nothing_else(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    mine = (await register_queue(agent, await new_identity(agent, offering))).json()
    second_offering = await backend.put_offering()
    await backend.grant(agent, second_offering)
    theirs = (await register_queue(agent, await new_identity(agent, second_offering))).json()
    subscription = await agent.create_subscription()
    legacy = (await agent.create_queue(subscription["uuid"], offering)).json()["queue_name"]

    async def refused(destination: str) -> bool:
        consumer = StompConsumer(agent.vhost, mine["rmq_username"], agent.token)
        await asyncio.to_thread(consumer.connect)
        try:
            consumer.subscribe(destination)
            return bool(await asyncio.to_thread(consumer.wait_refused, 3.0))
        finally:
            consumer.close()

    assert await refused(f"/amq/queue/{theirs['queue_name']}")  # another consumer's
    assert await refused(f"/amq/queue/{legacy}")  # a legacy queue of the same owner
    made_up = f"consumer_{uuid.uuid4().hex}"
    assert await refused(f"/queue/{made_up}")  # creating one
    assert await management.get_queue(agent.vhost, made_up) is None
    assert not await refused(f"/amq/queue/{mine['queue_name']}")  # control: its own


async def test_no_body_at_all_reads_as_an_empty_object(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    response = await agent.client.post(
        f"{IDENTITIES}{identity}/register_queue/", headers=agent.headers
    )
    assert response.status_code == 201, response.text
    assert sorted(response.json()["observable_object_types"]) == CLIENT_813_ENUM
