"""Registration calls for the same queue or identity sent to different replicas at once (an
agent retrying behind a load balancer): never a 5xx, and one row each in the end.

Each replica is a whole app with its own engine, pool, publisher and scheduler, on the one
database, as separate `queuekeeper serve` processes are (the cluster scenario runs those).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from sqlalchemy import func, select

from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.models import AgentIdentity, EventSubscription, EventSubscriptionQueue
from tests.helpers import Agent, Backend
from tests.identities.test_identities import IDENTITIES, agent_body
from tests.identities.test_register_event_subscription import register_subscription


async def _replicas(make_client: Any, count: int = 3) -> list[httpx.AsyncClient]:
    return [await make_client() for _ in range(count)]


def _as(agent: Agent, client: httpx.AsyncClient) -> Agent:
    return Agent(client, agent.uuid, agent.token)


async def _count(settings: Settings, model: Any) -> int:
    engine = create_engine(settings)
    try:
        async with engine.connect() as connection:
            return int(await connection.scalar(select(func.count()).select_from(model)) or 0)
    finally:
        await engine.dispose()


async def test_the_same_registrations_on_three_replicas_converge_without_5xx(
    settings: Settings, make_client: Any
) -> None:
    replicas = await _replicas(make_client)
    backend = Backend(replicas[0], "")
    backend.headers = {"Authorization": f"Bearer {settings.service_tokens[0]}"}
    agent, offering = await backend.agent_with_offering()

    # One identity, created on three replicas at once: one 201, the others 409 naming it.
    created = await asyncio.gather(
        *(
            replica.post(IDENTITIES, json=agent_body(offering.hex), headers=agent.headers)
            for replica in replicas
        )
    )
    assert sorted(r.status_code for r in created) == [201, 409, 409], [r.text for r in created]
    identity = next(r.json()["uuid"] for r in created if r.status_code == 201)
    assert all(identity in r.json()["detail"] for r in created if r.status_code == 409)

    # The agent's start-up call, on three replicas at once: one subscription.
    registered = await asyncio.gather(
        *(register_subscription(_as(agent, replica), identity) for replica in replicas)
    )
    assert sorted(r.status_code for r in registered) == [200, 200, 201]
    assert len({r.json()["uuid"] for r in registered}) == 1
    subscription = registered[0].json()["uuid"]

    # create_queue for the same queue, on three replicas at once: one queue.
    queued = await asyncio.gather(
        *(_as(agent, replica).create_queue(subscription, offering) for replica in replicas)
    )
    assert sorted(r.status_code for r in queued) == [200, 200, 201], [r.text for r in queued]
    assert len({r.json()["uuid"] for r in queued}) == 1

    assert await _count(settings, AgentIdentity) == 1
    assert await _count(settings, EventSubscription) == 1
    assert await _count(settings, EventSubscriptionQueue) == 1
