"""The operator's view of site agents: GET /api/admin/agent-identities/."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.helpers import Backend
from tests.identities.test_identities import register
from tests.identities.test_register_event_subscription import register_subscription
from tests.stomp_client import StompConsumer

ADMIN = "/api/admin/agent-identities/"


async def test_operator_sees_each_agent_its_subscriptions_and_who_consumes(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    other, other_offering = await backend.agent_with_offering()
    identity = (await register(agent, offering.hex)).json()
    await register(other, other_offering.hex)
    order = (await register_subscription(agent, identity["uuid"], "order")).json()
    resource = (await register_subscription(agent, identity["uuid"], "resource")).json()
    queue = (await agent.create_queue(order["uuid"], offering)).json()["queue_name"]
    # The resource subscription never got its queue: the agent stopped half-way.

    consumer = StompConsumer(agent.vhost, order["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{queue}", sub_id=queue)
        deadline = time.monotonic() + 15  # the broker refreshes consumer counts every ~5 s
        while True:
            response = await client.get(
                ADMIN, params={"offering_uuid": str(offering)}, headers=backend.headers
            )
            assert response.status_code == 200, response.text
            (item,) = response.json()
            queues = item["subscriptions"][0]["queues"]
            if queues[0]["consumers"] == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        consumer.close()

    assert item["uuid"] == identity["uuid"]
    assert item["owner_uuid"] == agent.uuid.hex
    assert item["owner_username"] == f"user-{agent.uuid.hex[:8]}"
    assert item["version"] == "1.0.5"
    assert item["last_restarted"] == "2026-11-21T22:25:36.755464Z"
    assert [(s["object_type"], s["subscription_uuid"]) for s in item["subscriptions"]] == [
        ("order", order["uuid"]),
        ("resource", resource["uuid"]),
    ]
    assert queues == [
        {
            "queue_name": queue,
            "vhost": agent.vhost,
            "offering_uuid": offering.hex,
            "present": True,
            "consumers": 1,
            "messages": 0,
        }
    ]
    assert item["subscriptions"][1]["queues"] == []

    # Unfiltered: both agents; broker=false answers from the database alone.
    response = await client.get(ADMIN, params={"broker": "false"}, headers=backend.headers)
    assert len(response.json()) == 2
    mine = next(i for i in response.json() if i["uuid"] == identity["uuid"])
    assert mine["subscriptions"][0]["queues"][0]["present"] is None
    response = await client.get(
        ADMIN, params={"user_uuid": other.uuid.hex}, headers=backend.headers
    )
    assert [i["owner_uuid"] for i in response.json()] == [other.uuid.hex]


async def test_only_service_tokens(client: httpx.AsyncClient, backend: Backend) -> None:
    agent, _offering = await backend.agent_with_offering()
    assert (await client.get(ADMIN)).status_code == 401
    assert (await client.get(ADMIN, headers=agent.headers)).status_code == 403
