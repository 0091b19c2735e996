"""Per-user quotas: one more than the limit is a 409 naming the limit and
its setting, and nothing is made on the broker for it.

Before: one agent made 200 subscriptions (200 broker users) without any offering access,
300 queues at 111/s, and 25 identities of about 1 MB each.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.helpers import Backend
from tests.identities.test_identities import IDENTITIES, register


def _refused(response: httpx.Response, setting: str, limit: int) -> dict[str, Any]:
    assert response.status_code == 409, response.text
    answer: dict[str, Any] = response.json()
    assert answer["setting"] == setting
    assert answer["limit"] == limit
    assert f"QUEUEKEEPER_{setting.upper()}" in answer["detail"]
    return answer


@pytest.mark.settings(max_subscriptions_per_user=3)
async def test_subscriptions_over_the_quota_are_refused_before_the_broker(
    client: httpx.AsyncClient,
    backend: Backend,
    management: ManagementClient,
    settings: Settings,
) -> None:
    agent = await backend.put_user()
    for _ in range(3):
        await agent.create_subscription()
    response = await client.post("/api/event-subscriptions/", json={}, headers=agent.headers)
    _refused(response, "max_subscriptions_per_user", 3)
    tag = settings.instance_tag
    users = [user for user in await management.list_users() if tag in user.tags]
    assert len(users) == 3
    # Another user has its own quota.
    await (await backend.put_user()).create_subscription()


@pytest.mark.settings(max_queues_per_user=2)
async def test_queues_over_the_quota_are_refused_but_existing_ones_still_answer(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = (await agent.create_subscription())["uuid"]
    assert (await agent.create_queue(subscription, offering, "order")).status_code == 201
    assert (await agent.create_queue(subscription, offering, "resource")).status_code == 201
    refused = await agent.create_queue(subscription, offering, "offering_user")
    _refused(refused, "max_queues_per_user", 2)
    # The quota is the user's, over all its subscriptions.
    other = (await agent.create_subscription())["uuid"]
    _refused(await agent.create_queue(other, offering, "order"), "max_queues_per_user", 2)
    # Registering an existing queue again is not "one more".
    assert (await agent.create_queue(subscription, offering, "order")).status_code == 200
    page = await management.list_queues_page(agent.vhost, page=1, page_size=100)
    names = [queue.name for queue in page.items]
    assert not [name for name in names if name.endswith("_offering_user")]


@pytest.mark.settings(max_identities_per_user=2)
async def test_identities_over_the_quota_are_refused(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    assert (await register(agent, offering.hex, name="a")).status_code == 201
    assert (await register(agent, offering.hex, name="b")).status_code == 201
    _refused(await register(agent, offering.hex, name="c"), "max_identities_per_user", 2)
    listing = await client.get(IDENTITIES, headers=agent.headers)
    assert len(listing.json()) == 2


@pytest.mark.settings(text_max_length=50)
async def test_free_text_over_its_length_is_a_400_naming_field_and_setting(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    response = await client.post(
        "/api/event-subscriptions/", json={"description": "d" * 51}, headers=agent.headers
    )
    assert response.status_code == 400, response.text
    assert response.json()["errors"][0]["field"] == "description"
    assert "QUEUEKEEPER_TEXT_MAX_LENGTH" in response.json()["detail"]
    response = await register(agent, offering.hex, name="n" * 51)
    assert response.status_code == 400, response.text
    assert response.json()["errors"][0]["field"] == "name"
    assert (await register(agent, offering.hex, name="n" * 50)).status_code == 201


@pytest.mark.settings(max_consumers_per_user=1)
async def test_consumers_over_the_quota_are_refused(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    first = await new_identity(agent, offering)
    assert (await register_queue(agent, first)).status_code == 201
    assert (await register_queue(agent, first)).status_code == 200  # the same one again
    second = await new_identity(agent, offering, name="second-agent")
    _refused(await register_queue(agent, second), "max_consumers_per_user", 1)
