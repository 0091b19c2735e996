"""The directory the backend pushes, and what its changes do on the broker."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from queuekeeper.broker.management import ManagementClient
from tests.helpers import Backend
from tests.stomp_client import StompConsumer


async def test_put_user_is_idempotent_and_keeps_unsent_fields(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    user_uuid = uuid.uuid4()
    body = {
        "username": "alice",
        "full_name": "Alice A",
        "email": "a@example.org",
        "token": "t" * 40,
    }
    first = await client.put(
        f"/api/internal/users/{user_uuid}/", json=body, headers=backend.headers
    )
    assert first.status_code == 201
    assert first.json()["uuid"] == user_uuid.hex
    assert first.json()["has_token"] is True
    again = await client.put(
        f"/api/internal/users/{user_uuid.hex}/",
        json={"username": "alice2"},
        headers=backend.headers,
    )
    assert again.status_code == 200
    assert again.json()["username"] == "alice2"
    assert again.json()["full_name"] == "Alice A"  # not sent, so kept
    me = await client.get("/api/users/me/", headers={"Authorization": f"Token {'t' * 40}"})
    assert me.status_code == 200  # token kept too

    cleared = await client.put(
        f"/api/internal/users/{user_uuid}/",
        json={"username": "alice2", "token": None},
        headers=backend.headers,
    )
    assert cleared.json()["has_token"] is False
    me = await client.get("/api/users/me/", headers={"Authorization": f"Token {'t' * 40}"})
    assert me.status_code == 401


async def test_directory_bad_input_names_the_field(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    response = await client.put(
        "/api/internal/users/not-a-uuid/", json={"username": "x"}, headers=backend.headers
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "user_uuid"

    response = await client.put(
        f"/api/internal/users/{uuid.uuid4()}/", json={}, headers=backend.headers
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "username"

    response = await client.put(
        f"/api/internal/users/{uuid.uuid4()}/",
        json={"username": "x", "token_expires_at": "next tuesday"},
        headers=backend.headers,
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "token_expires_at"

    taken = await backend.put_user()
    response = await client.put(
        f"/api/internal/users/{uuid.uuid4()}/",
        json={"username": "y", "token": taken.token},
        headers=backend.headers,
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "token"

    response = await client.put(
        f"/api/internal/offerings/{uuid.uuid4()}/users/{uuid.uuid4()}/", headers=backend.headers
    )
    assert response.status_code == 404
    assert "PUT the user first" in response.json()["detail"]


async def test_offerings_and_grants_are_idempotent(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = uuid.uuid4()
    url = f"/api/internal/offerings/{offering}/"
    first = await client.put(url, json={"name": "HPC", "state": "Active"}, headers=backend.headers)
    assert first.status_code == 201
    second = await client.put(url, json={"name": "HPC 2"}, headers=backend.headers)
    assert second.status_code == 200
    assert second.json() == {**first.json(), "name": "HPC 2", "modified": second.json()["modified"]}

    agent = await backend.put_user()
    grant_url = f"/api/internal/offerings/{offering}/users/{agent.uuid}/"
    assert (await client.put(grant_url, headers=backend.headers)).status_code == 201
    assert (await client.put(grant_url, headers=backend.headers)).status_code == 200
    assert (await client.delete(grant_url, headers=backend.headers)).status_code == 204
    assert (await client.delete(grant_url, headers=backend.headers)).status_code == 204
    assert (await client.delete(url, headers=backend.headers)).status_code == 204
    assert (await client.delete(url, headers=backend.headers)).status_code == 204
    missing = f"/api/internal/users/{uuid.uuid4()}/"
    assert (await client.delete(missing, headers=backend.headers)).status_code == 204


async def test_token_change_changes_every_broker_password(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, _offering = await backend.agent_with_offering()
    subscriptions = [await agent.create_subscription() for _ in range(2)]
    new_token = "n" * 40
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/",
        json={"username": "renamed", "token": new_token},
        headers=backend.headers,
    )
    assert response.status_code == 200
    for subscription in subscriptions:
        old = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
        try:
            await asyncio.to_thread(old.connect)
            refused = await asyncio.to_thread(old.wait_refused, 3.0)
        except Exception:
            refused = True
        finally:
            old.close()
        assert refused, "the old token must stop working as a broker password"
        new = StompConsumer(agent.vhost, subscription["uuid"], new_token)
        await asyncio.to_thread(new.connect)
        try:
            assert new.connection.is_connected()
        finally:
            new.close()


async def test_token_change_while_broker_down_answers_503_and_repeat_finishes(
    client: httpx.AsyncClient, backend: Backend, make_client: object
) -> None:
    agent, _offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    dead = await make_client(management_url="http://127.0.0.1:9")  # type: ignore[operator]
    body = {"username": "u", "token": "z" * 40}
    response = await dead.put(
        f"/api/internal/users/{agent.uuid}/", json=body, headers=backend.headers
    )
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "7"
    assert "repeat the same PUT" in response.json()["detail"]
    # The row is saved: the new token already authenticates over REST.
    me = await client.get("/api/users/me/", headers={"Authorization": f"Token {'z' * 40}"})
    assert me.status_code == 200
    # Repeating the PUT against a reachable broker brings the broker user up to date.
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/", json=body, headers=backend.headers
    )
    assert response.status_code == 200
    consumer = StompConsumer(agent.vhost, subscription["uuid"], "z" * 40)
    await asyncio.to_thread(consumer.connect)
    try:
        assert consumer.connection.is_connected()
    finally:
        consumer.close()


async def test_revoking_access_deletes_that_offerings_queues_only(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    other_offering = await backend.put_offering()
    await backend.grant(agent, other_offering)
    subscription = await agent.create_subscription()
    revoked = (await agent.create_queue(subscription["uuid"], offering)).json()
    kept = (await agent.create_queue(subscription["uuid"], other_offering)).json()

    response = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=backend.headers
    )
    assert response.status_code == 204
    assert await management.get_queue(agent.vhost, revoked["queue_name"]) is None
    assert await management.get_queue(agent.vhost, kept["queue_name"]) is not None
    listed = (await client.get("/api/event-subscription-queues/", headers=agent.headers)).json()
    assert [queue["uuid"] for queue in listed] == [kept["uuid"]]
    # And the agent can no longer register one for it.
    response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 403


async def test_deleting_an_offering_deletes_its_queues_everywhere(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    offering = await backend.put_offering()
    agents = [await backend.put_user() for _ in range(2)]
    names = []
    for agent in agents:
        await backend.grant(agent, offering)
        subscription = await agent.create_subscription()
        names.append((agent, (await agent.create_queue(subscription["uuid"], offering)).json()))
    response = await client.delete(f"/api/internal/offerings/{offering}/", headers=backend.headers)
    assert response.status_code == 204
    for agent, queue in names:
        assert await management.get_queue(agent.vhost, queue["queue_name"]) is None
        # The subscription stays; only the queue for the gone offering went.
        assert await management.get_vhost(agent.vhost) is not None


async def test_deleting_a_user_leaves_nothing_on_the_broker(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscriptions = [await agent.create_subscription() for _ in range(2)]
    for subscription in subscriptions:
        assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201
    response = await client.delete(f"/api/internal/users/{agent.uuid}/", headers=backend.headers)
    assert response.status_code == 204
    assert await management.get_vhost(agent.vhost) is None
    for subscription in subscriptions:
        assert await management.get_user(subscription["uuid"]) is None
    response = await client.get("/api/users/me/", headers=agent.headers)
    assert response.status_code == 401


@pytest.mark.parametrize("what", ["user", "offering"])
async def test_deletion_is_not_blocked_by_a_broker_outage(
    backend: Backend, make_client: object, what: str
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201
    dead = await make_client(management_url="http://127.0.0.1:9")  # type: ignore[operator]
    target = agent.uuid if what == "user" else offering
    response = await dead.delete(f"/api/internal/{what}s/{target}/", headers=backend.headers)
    assert response.status_code == 204
    listed = await dead.get("/api/event-subscription-queues/", headers=agent.headers)
    if what == "user":
        assert listed.status_code == 401  # the user, and so its token, is gone
    else:
        assert listed.json() == []


async def test_a_token_expiry_out_of_range_in_utc_is_a_400_naming_the_field(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """Stored in UTC, 0001-01-01T00:00:00+14:00 falls before year 1: a 400, not a 500."""
    response = await client.put(
        f"/api/internal/users/{uuid.uuid4()}/",
        json={"username": "x", "token_expires_at": "0001-01-01T00:00:00+14:00"},
        headers=backend.headers,
    )
    assert response.status_code == 400, response.text
    assert response.json()["errors"][0]["field"] == "token_expires_at"
    assert "out of range" in response.json()["errors"][0]["message"]
