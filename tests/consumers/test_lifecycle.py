"""What happens to consumers when what they depend on goes away (contract §9, lifecycle)."""

from __future__ import annotations

import httpx
import pytest

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.consumers.scopes import role, scopes, tree
from tests.consumers.sweeps import swept
from tests.consumers.test_fan_out import group_event
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.events.support import drain, event_detail, order_event, post_event, queue_depth
from tests.helpers import Agent, Backend
from tests.security.test_races import amqp_login

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}

CONSUMERS = "/api/event-consumers/"


async def gone_from_broker(
    management: ManagementClient, vhost: str, answer: dict[str, str]
) -> bool:
    return (
        await management.get_queue(vhost, answer["queue_name"]) is None
        and await management.get_user(answer["rmq_username"]) is None
    )


async def consumers_of(agent: Agent) -> list[dict[str, object]]:
    response = await agent.client.get(CONSUMERS, headers=agent.headers)
    assert response.status_code == 200
    items: list[dict[str, object]] = response.json()
    return items


async def test_deleting_the_identity_deletes_its_consumer(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    answer = (await register_queue(agent, identity)).json()
    response = await agent.client.delete(
        f"/api/marketplace-site-agent-identities/{identity}/", headers=agent.headers
    )
    assert response.status_code == 204
    assert await consumers_of(agent) == []
    assert await gone_from_broker(management, agent.vhost, answer)
    assert await management.get_vhost(agent.vhost) is None  # nothing else lived in it


async def test_revoking_access_deletes_consumers_bound_to_that_offering_alone(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    second = await backend.put_offering()
    await backend.grant(agent, second)
    agent_consumer = (await register_queue(agent, await new_identity(agent, offering))).json()
    both = await agent.client.post(
        f"{CONSUMERS}register/",
        json={"scopes": [{"type": "offering", "uuid": o.hex} for o in (offering, second)]},
        headers=agent.headers,
    )
    assert both.status_code == 201

    response = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=backend.headers
    )
    assert response.status_code == 204
    (left,) = await consumers_of(agent)
    assert left["rmq_username"] == both.json()["rmq_username"]
    assert left["scopes"] == [{"type": "offering", "uuid": second.hex}]
    assert await gone_from_broker(management, agent.vhost, agent_consumer)
    assert await management.get_queue(agent.vhost, both.json()["queue_name"]) is not None


async def test_deleting_the_offering_or_the_user(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    answer = (await register_queue(agent, await new_identity(agent, offering))).json()
    response = await client.delete(f"/api/internal/offerings/{offering}/", headers=backend.headers)
    assert response.status_code == 204
    assert await consumers_of(agent) == []
    assert await gone_from_broker(management, agent.vhost, answer)

    other = await backend.put_offering()
    await backend.grant(agent, other)
    answer = (await register_queue(agent, await new_identity(agent, other))).json()
    response = await client.delete(f"/api/internal/users/{agent.uuid}/", headers=backend.headers)
    assert response.status_code == 204
    assert await gone_from_broker(management, agent.vhost, answer)
    assert await management.get_vhost(agent.vhost) is None


async def test_a_consumer_keeps_the_vhost_when_the_last_subscription_goes(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    answer = (await register_queue(agent, await new_identity(agent, offering))).json()
    response = await agent.client.delete(
        f"/api/event-subscriptions/{subscription['uuid']}/", headers=agent.headers
    )
    assert response.status_code == 204
    assert await management.get_vhost(agent.vhost) is not None
    assert await management.get_queue(agent.vhost, answer["queue_name"]) is not None


async def test_a_revoked_offerings_copies_leave_a_consumer_that_keeps_other_scopes(
    backend: Backend, client: httpx.AsyncClient, settings: Settings
) -> None:
    """A consumer scoped to X and Z keeps Z when the grant of X is revoked, and X's copies
    already in its queue go (docs/decisions/030-queued-copies-on-every-access-loss.md); Z's
    stay, in order, and its login works again afterwards. Before: X's event was still
    delivered."""
    agent, revoked = await backend.agent_with_offering()
    kept = await backend.put_offering()
    await backend.grant(agent, kept)
    scopes = [{"type": "offering", "uuid": str(o)} for o in (revoked, kept)]
    answer = await agent.client.post(
        "/api/event-consumers/register/", json={"scopes": scopes}, headers=agent.headers
    )
    assert answer.status_code == 201, answer.text
    queue, login = answer.json()["queue_name"], answer.json()["rmq_username"]
    sent = []
    for offering in (kept, revoked, kept, revoked, kept):
        response = await post_event(client, order_event(offering), wait=True)
        assert response.status_code in (200, 201, 202), response.text
        sent.append((offering, response.json()["event_id"]))
    assert await queue_depth(agent.vhost, queue) == 5

    response = await client.delete(
        f"/api/internal/offerings/{revoked}/users/{agent.uuid}/", headers=SERVICE
    )
    assert response.status_code == 204, response.text
    await swept(settings)
    left = await drain(agent.vhost, queue)
    assert [m.message_id for m in left] == [event for o, event in sent if o == kept]
    assert {(m.headers or {}).get("offering_uuid") for m in left} == {kept.hex}
    consumers = (await client.get(f"/api/event-consumers/{login}/", headers=SERVICE)).json()
    assert [scope["uuid"] for scope in consumers["scopes"]] == [kept.hex]
    assert await amqp_login(agent.vhost, login, agent.token)


@pytest.mark.settings(relay_enabled=False)
async def test_a_revoked_offerings_fan_out_copies_are_given_up_by_the_copys_offering(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """An event sent to offerings [other, X] reaches a consumer scoped to X and Z as X's copy:
    revoking X gives that copy up while it waits in the outbox, although the event's first
    offering is another. Before: only copies whose event named X first were given up, and
    this one was published after the revoke."""
    agent, revoked = await backend.agent_with_offering()
    kept = await backend.put_offering()
    other = await backend.put_offering()  # named first in the event; the consumer lacks it
    await backend.grant(agent, kept)
    scopes = [{"type": "offering", "uuid": str(o)} for o in (revoked, kept)]
    answer = await agent.client.post(
        "/api/event-consumers/register/", json={"scopes": scopes}, headers=agent.headers
    )
    assert answer.status_code == 201, answer.text
    queue = answer.json()["queue_name"]
    event = group_event([other, revoked], event_id="fan-out-revoked")
    assert (await post_event(client, event)).status_code in (200, 201, 202)
    kept_event = group_event([other, kept], event_id="fan-out-kept")
    assert (await post_event(client, kept_event)).status_code in (200, 201, 202)

    response = await client.delete(
        f"/api/internal/offerings/{revoked}/users/{agent.uuid}/", headers=SERVICE
    )
    assert response.status_code == 204, response.text
    gone = await event_detail(client, "fan-out-revoked")
    assert [(d["queue_name"], d["state"]) for d in gone["deliveries"]] == [(queue, "given_up")]
    stays = await event_detail(client, "fan-out-kept")
    assert [(d["queue_name"], d["state"]) for d in stays["deliveries"]] == [(queue, "pending")]


async def test_revoking_access_narrows_a_consumer_also_bound_to_a_customer(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """Scoped only to the offering is what is deleted (contract §9): a consumer bound to the
    offering and to a customer on which its owner holds a role keeps the customer, and the
    customer's events still reach it."""
    agent, offering = await backend.agent_with_offering()
    entities = await tree(client)
    await role(client, agent, "customer", entities.customer)
    both = await agent.client.post(
        f"{CONSUMERS}register/",
        json={"scopes": scopes(("offering", offering), ("customer", entities.customer))},
        headers=agent.headers,
    )
    assert both.status_code == 201, both.text

    response = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=backend.headers
    )
    assert response.status_code == 204
    (left,) = await consumers_of(agent)
    assert left["rmq_username"] == both.json()["rmq_username"]
    assert left["scopes"] == [{"type": "customer", "uuid": entities.customer.hex}]
    answer = await post_event(client, order_event(entities.offering))
    assert answer.json()["queued"] == 1, answer.text
