"""/api/event-consumers/ (contract §9): for integrations that are not site agents, shaped as
waldur-api-client 8.1.2's EventConsumer* models."""

from __future__ import annotations

import uuid

import httpx

from queuekeeper.broker.management import ManagementClient
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend

CONSUMERS = "/api/event-consumers/"
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
# EventConsumer.from_dict needs these (agent-protocols 1.0.7 §3.4); the rest are
# queuekeeper's additions.
EVENT_CONSUMER_KEYS = {
    "uuid",
    "object_types",
    "scopes",
    "is_global",
    "rmq_username",
    "queue_created",
    "created",
    "modified",
    # required by waldur-api-client 8.1.3's EventConsumer
    "user_uuid",
    "user_username",
    "user_full_name",
    "user_is_staff",
    "auth_kind",
    "auth_token_prefix",
    "auth_token_name",
    "authorized_via",
    "delivery_blocked_reason",
    # required by waldur-api-client 8.1.4's EventConsumer
    "delivery",
    "webhook_destination",
    "payload_filters",
    "last_delivered_at",
    "last_error",
    "last_error_at",
}


async def register(agent: Agent, body: object) -> httpx.Response:
    return await agent.client.post(f"{CONSUMERS}register/", json=body, headers=agent.headers)


async def test_register_list_get_delete(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    other_offering = await backend.put_offering()
    await backend.grant(agent, other_offering)
    scopes = [
        {"type": "offering", "uuid": str(offering)},
        {"type": "offering", "uuid": other_offering.hex},
    ]
    first = await register(agent, {"object_types": ["order"], "scopes": scopes})
    assert first.status_code == 201, first.text
    answer = first.json()
    # EventConsumerRegistrationResponse's fields, and the consumer's 8.1.4 ones beside them.
    assert set(answer) >= {"rmq_username", "queue_name", "vhost", "observable_object_types"}
    assert answer["delivery"] == "rmq"
    assert answer["observable_object_types"] == ["order"]
    assert await management.get_queue(agent.vhost, answer["queue_name"]) is not None

    # The same offerings (in any order): the same consumer; the filter follows the body.
    again = await register(agent, {"object_types": [], "scopes": scopes[::-1]})
    assert again.status_code == 200
    assert again.json()["queue_name"] == answer["queue_name"]
    assert len(again.json()["observable_object_types"]) == 18
    # Other offerings: another consumer.
    single = await register(agent, {"scopes": scopes[:1]})
    assert single.status_code == 201
    assert single.json()["queue_name"] != answer["queue_name"]

    listed = await client.get(CONSUMERS, headers=agent.headers)
    assert listed.status_code == 200
    assert listed.headers["X-Result-Count"] == "2"
    counted = await client.head(CONSUMERS, headers=agent.headers)
    assert (counted.status_code, counted.headers["X-Result-Count"]) == (200, "2")
    items = listed.json()
    assert all(set(item) >= EVENT_CONSUMER_KEYS for item in items)
    first_item = next(i for i in items if i["rmq_username"] == answer["rmq_username"])
    assert first_item["object_types"] == []
    assert first_item["scopes"] == sorted(
        [
            {"type": "offering", "uuid": offering.hex},
            {"type": "offering", "uuid": other_offering.hex},
        ],
        key=lambda scope: scope["uuid"],
    )
    assert (first_item["is_global"], first_item["queue_created"]) == (False, True)
    assert first_item["agent_identity_uuid"] is None

    # Another agent sees none of them; the service token sees all.
    stranger = await backend.put_user()
    assert (await client.get(CONSUMERS, headers=stranger.headers)).json() == []
    assert (
        await client.get(f"{CONSUMERS}{first_item['uuid']}/", headers=stranger.headers)
    ).status_code == 404
    assert len((await client.get(CONSUMERS, headers=SERVICE)).json()) == 2
    one = await client.get(f"{CONSUMERS}{first_item['uuid']}/", headers=agent.headers)
    assert one.json() == first_item

    assert (
        await client.delete(f"{CONSUMERS}{first_item['uuid']}/", headers=stranger.headers)
    ).status_code == 404
    deleted = await client.delete(f"{CONSUMERS}{first_item['uuid']}/", headers=agent.headers)
    assert deleted.status_code == 204
    assert await management.get_queue(agent.vhost, answer["queue_name"]) is None
    assert await management.get_user(answer["rmq_username"]) is None
    # The vhost stays: the other consumer lives in it.
    assert await management.get_vhost(agent.vhost) is not None
    assert (
        await client.get(f"{CONSUMERS}{first_item['uuid']}/", headers=agent.headers)
    ).status_code == 404
    gone = await client.delete(f"{CONSUMERS}{single.json()['rmq_username']}/", headers=SERVICE)
    assert gone.status_code == 204
    assert await management.get_vhost(agent.vhost) is None


async def test_bad_registrations(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    unknown = uuid.uuid4().hex
    cases = [
        ({}, "scopes"),
        ({"scopes": [{"type": "team", "uuid": offering.hex}]}, "scopes.0.type"),
        ({"scopes": [{"type": "project", "uuid": offering.hex}]}, "scopes.0.uuid"),
        ({"scopes": [{"type": "offering", "uuid": "nope"}]}, "scopes.0.uuid"),
        ({"scopes": [{"type": "offering", "uuid": unknown}]}, "scopes.0.uuid"),
        (
            {"scopes": [{"type": "offering", "uuid": offering.hex}] * 2},
            "scopes",
        ),
        (
            {"scopes": [{"type": "offering", "uuid": offering.hex}], "object_types": ["x"]},
            "object_types.0",
        ),
        ("scopes", "body"),
    ]
    for body, field in cases:
        response = await register(agent, body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["errors"][0]["field"] == field, (body, response.text)
    stranger_offering = await backend.put_offering()
    forbidden = await register(
        agent, {"scopes": [{"type": "offering", "uuid": stranger_offering.hex}]}
    )
    assert forbidden.status_code == 403
    assert (await agent.client.get(CONSUMERS, headers=agent.headers)).json() == []


async def test_owner_and_auth_fields_and_the_list_filters(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    other, other_offering = await backend.agent_with_offering()
    scope = [{"type": "offering", "uuid": offering.hex}]
    first = await register(agent, {"object_types": ["order", "resource"], "scopes": scope})
    second = await register(
        agent,
        {"scopes": [*scope, {"type": "offering", "uuid": (await backend.put_offering()).hex}]},
    )
    assert second.status_code == 403  # no access to the new offering: nothing made
    await register(other, {"scopes": [{"type": "offering", "uuid": other_offering.hex}]})

    (mine,) = (await client.get(CONSUMERS, headers=agent.headers)).json()
    assert mine["object_types"] == ["order", "resource"]  # a list, as 8.1.3 declares it
    assert mine["user_uuid"] == agent.uuid.hex
    assert mine["user_username"] == f"user-{agent.uuid.hex[:8]}"
    assert (mine["user_is_staff"], mine["auth_kind"], mine["auth_token_name"]) == (
        False,
        "token",
        "",
    )
    assert mine["auth_token_prefix"] == agent.token[:8]
    assert mine["authorized_via"] == "self"
    assert mine["delivery_blocked_reason"] is None
    assert first.json()["queue_name"] == mine["queue_name"]

    everyone = (await client.get(CONSUMERS, headers=SERVICE)).json()
    assert {item["authorized_via"] for item in everyone} == {"staff"}
    assert [i["created"] for i in everyone] == sorted(i["created"] for i in everyone)

    async def listed(**params: str) -> list[str]:
        response = await client.get(CONSUMERS, params=params, headers=SERVICE)
        assert response.status_code == 200, response.text
        counted = await client.head(CONSUMERS, params=params, headers=SERVICE)
        assert counted.headers["X-Result-Count"] == str(len(response.json()))
        return [item["user_uuid"] for item in response.json()]

    assert await listed(user_uuid=str(agent.uuid)) == [agent.uuid.hex]
    assert await listed(user_username=f"user-{other.uuid.hex[:8]}") == [other.uuid.hex]
    assert await listed(is_global="true") == []
    assert len(await listed(is_global="false")) == 2
    assert await listed(o="-created") == (await listed(o="created"))[::-1]
    for params, field in (({"user_uuid": "nope"}, "user_uuid"), ({"o": "name"}, "o")):
        bad = await client.get(CONSUMERS, params=params, headers=SERVICE)
        assert bad.status_code == 400, bad.text
        assert field in bad.json()["errors"][0]["field"]
