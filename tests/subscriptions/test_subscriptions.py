"""Subscription and queue resources: shapes, ownership, filters, cascades."""

from __future__ import annotations

import httpx

from queuekeeper.broker.management import ManagementClient
from tests.helpers import Backend


async def test_subscription_shape_matches_waldur(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user(full_name="Agent Smith")
    subscription = await agent.create_subscription(
        description="d", observable_objects=[{"object_type": "resource", "object_id": "42"}]
    )
    assert set(subscription) == {
        "uuid", "url", "user", "user_uuid", "user_username", "user_full_name",
        "created", "modified", "source_ip", "description", "observable_objects",
    }  # fmt: skip
    assert len(subscription["uuid"]) == 32
    assert (
        subscription["url"] == f"http://testserver/api/event-subscriptions/{subscription['uuid']}/"
    )
    assert subscription["user_full_name"] == "Agent Smith"
    assert subscription["created"].endswith("Z")
    assert subscription["observable_objects"] == [{"object_type": "resource", "object_id": "42"}]

    response = await client.post(
        "/api/event-subscriptions/",
        json={"observable_objects": [{"object_type": "nope"}]},
        headers=agent.headers,
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "observable_objects.0.object_type"


async def test_only_your_own_subscriptions_and_queues(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, _offering = await backend.agent_with_offering()
    other, other_offering = await backend.agent_with_offering()
    mine = await agent.create_subscription()
    theirs = await other.create_subscription()
    their_queue = (await other.create_queue(theirs["uuid"], other_offering)).json()

    listed = await client.get("/api/event-subscriptions/", headers=agent.headers)
    assert [item["uuid"] for item in listed.json()] == [mine["uuid"]]
    assert listed.headers["X-Result-Count"] == "1"
    for path in (
        f"/api/event-subscriptions/{theirs['uuid']}/",
        f"/api/event-subscription-queues/{their_queue['uuid']}/",
        "/api/event-subscriptions/12345/",
    ):
        assert (await client.get(path, headers=agent.headers)).status_code == 404
        assert (await client.delete(path, headers=agent.headers)).status_code == 404
    assert (await client.get("/api/event-subscription-queues/", headers=agent.headers)).json() == []


async def test_an_unknown_action_with_its_slash_is_not_told_to_add_one(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    subscription = await agent.create_subscription()
    path = f"/api/event-subscriptions/{subscription['uuid']}/register_queue/"
    response = await client.post(path, json={}, headers=agent.headers)
    assert response.status_code == 404
    assert response.json() == {"detail": f"No such endpoint: {path}."}


async def test_queue_filters_and_pagination(client: httpx.AsyncClient, backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    second = await backend.put_offering()
    await backend.grant(agent, second)
    subscription = await agent.create_subscription()
    for object_type in ("order", "resource", "user_role"):
        await agent.create_queue(subscription["uuid"], offering, object_type)
    await agent.create_queue(subscription["uuid"], second, "order")

    async def names(**params: str) -> list[str]:
        response = await client.get(
            "/api/event-subscription-queues/", params=params, headers=agent.headers
        )
        assert response.status_code == 200, response.text
        return sorted(item["object_type"] + ":" + item["offering_uuid"] for item in response.json())

    assert await names(object_type="order") == sorted(
        [f"order:{offering.hex}", f"order:{second.hex}"]
    )
    assert await names(offering_uuid=str(second)) == [f"order:{second.hex}"]
    assert len(await names(event_subscription_uuid=subscription["uuid"])) == 4
    page = await client.get(
        "/api/event-subscription-queues/", params={"page_size": 3}, headers=agent.headers
    )
    assert len(page.json()) == 3
    assert page.headers["X-Result-Count"] == "4"
    assert 'rel="next"' in page.headers["Link"]


async def test_deleting_a_queue_deletes_the_broker_queue(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    queue = (await agent.create_queue(subscription["uuid"], offering)).json()
    response = await client.delete(
        f"/api/event-subscription-queues/{queue['uuid']}/", headers=agent.headers
    )
    assert response.status_code == 204
    assert await management.get_queue(agent.vhost, queue["queue_name"]) is None
    assert await management.get_vhost(agent.vhost) is not None


async def test_deleting_subscriptions_cascades_and_last_one_takes_the_vhost(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    first = await agent.create_subscription()
    second = await agent.create_subscription()
    q1 = (await agent.create_queue(first["uuid"], offering)).json()
    q2 = (await agent.create_queue(second["uuid"], offering)).json()

    assert (
        await client.delete(f"/api/event-subscriptions/{first['uuid']}/", headers=agent.headers)
    ).status_code == 204
    assert await management.get_queue(agent.vhost, q1["queue_name"]) is None
    assert await management.get_user(first["uuid"]) is None
    assert await management.get_queue(agent.vhost, q2["queue_name"]) is not None
    assert await management.get_vhost(agent.vhost) is not None
    listed = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert [item["uuid"] for item in listed.json()] == [q2["uuid"]]

    assert (
        await client.delete(f"/api/event-subscriptions/{second['uuid']}/", headers=agent.headers)
    ).status_code == 204
    assert await management.get_user(second["uuid"]) is None
    assert await management.get_vhost(agent.vhost) is None


async def test_broker_down_when_subscribing_is_a_503_with_no_row(
    backend: Backend, make_client: object, client: httpx.AsyncClient
) -> None:
    agent = await backend.put_user()
    dead = await make_client(management_url="http://127.0.0.1:9")  # type: ignore[operator]
    response = await dead.post("/api/event-subscriptions/", json={}, headers=agent.headers)
    assert response.status_code == 503
    assert "Retry-After" in response.headers
    assert (await client.get("/api/event-subscriptions/", headers=agent.headers)).json() == []


async def test_a_vhost_not_tagged_as_ours_is_never_used(
    backend: Backend, management: ManagementClient
) -> None:
    agent = await backend.put_user()
    await management.put_vhost(agent.vhost, description="someone else's", tags=["other:app"])
    try:
        response = await agent.client.post(
            "/api/event-subscriptions/", json={}, headers=agent.headers
        )
        assert response.status_code == 409
        assert "not tagged" in response.json()["detail"]
        vhost = await management.get_vhost(agent.vhost)
        assert vhost is not None
        assert vhost.tags == ("other:app",)
    finally:
        await management.delete_vhost(agent.vhost)
