"""What happens to consumers when what they depend on goes away (contract §9, lifecycle)."""

from __future__ import annotations

import httpx

from queuekeeper.broker.management import ManagementClient
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.helpers import Agent, Backend

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
