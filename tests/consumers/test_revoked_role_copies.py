"""A revoked role takes its copies out of the queue (contract §11, §12, §14;
docs/decisions/030-queued-copies-on-every-access-loss.md): when the backend deletes a role,
moves it or pushes it expired, the `sweep_access` job takes the copies already on the broker
that its user may no longer receive out of that user's consumers' queues; those it still
may receive (through another role, the event's own project, its own user) stay, in order. A
real STOMP consumer holds one unacked copy while the role goes, and reads the queue again
afterwards."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest

from queuekeeper.config import Settings
from queuekeeper.models import utcnow
from tests.consumers.scopes import put, role, scopes, tree, unrole
from tests.consumers.sweeps import read_when_let_in, sent, swept
from tests.consumers.test_scoped_delivery import consumer_of, identity_event
from tests.events.support import order_event
from tests.helpers import Agent, Backend
from tests.stomp_client import StompConsumer


def reader(agent: Agent, consumer: dict[str, Any], *, prefetch: int | None = None) -> StompConsumer:
    """Subscribed to the consumer's queue; with a prefetch, holding what it got unacked."""
    stomp = StompConsumer(agent.vhost, consumer["rmq_username"], agent.token)
    stomp.connect()
    ack = "client-individual" if prefetch is not None else "auto"
    stomp.subscribe(f"/amq/queue/{consumer['queue_name']}", ack=ack, prefetch=prefetch)
    return stomp


async def read_all(agent: Agent, consumer: dict[str, Any], count: int) -> list[str]:
    """The message ids a new STOMP subscriber reads off the queue (waiting a moment for
    anything beyond `count`), once the sweep let it in again."""
    return await read_when_let_in(agent, consumer, count)


async def expire(
    client: httpx.AsyncClient, agent: Agent, role_uuid: uuid.UUID, kind: str, entity: uuid.UUID
) -> None:
    await put(
        client,
        f"/roles/{role_uuid}/",
        {
            "user_uuid": agent.uuid.hex,
            "role_name": f"{kind}.member",
            "scope": {"type": kind, "uuid": entity.hex},
            "expires_at": (utcnow() - timedelta(seconds=1)).isoformat(),
        },
    )


@pytest.mark.parametrize("how", ["deleted", "expired", "moved"])
async def test_a_revoked_roles_copies_leave_the_queue_and_the_rest_stay_in_order(
    backend: Backend, client: httpx.AsyncClient, settings: Settings, how: str
) -> None:
    lost, kept, elsewhere = await tree(client), await tree(client), await tree(client)
    watcher = await backend.put_user()
    revoked = await role(client, watcher, "customer", lost.customer)
    await role(client, watcher, "project", kept.project)
    mine = await consumer_of(
        watcher,
        {
            "scopes": scopes(
                ("customer", lost.customer), ("project", kept.project), ("user", watcher.uuid)
            )
        },
    )
    # Another consumer of the same user, holding nothing the revocation touches.
    untouched = await consumer_of(watcher, {"scopes": scopes(("project", kept.project))})
    events = [
        ("lost", await sent(client, order_event(lost.offering))),
        ("kept", await sent(client, order_event(kept.offering))),
        # Another provider's offering, ordered in the kept project: received through the
        # event's own project, which no offering-level check would see.
        (
            "kept",
            await sent(client, order_event(elsewhere.offering, project_uuid=kept.project.hex)),
        ),
        ("lost", await sent(client, order_event(lost.offering))),
        ("kept", await sent(client, identity_event(watcher.uuid))),
        ("lost", await sent(client, order_event(lost.offering))),
    ]
    # The agent reads with a prefetch of 1: the first (lost) copy is held unacked.
    agent = await asyncio.to_thread(reader, watcher, mine, prefetch=1)
    bystander = await asyncio.to_thread(reader, watcher, untouched)
    try:
        assert len(await asyncio.to_thread(agent.wait_for, 1)) == 1
        assert len(await asyncio.to_thread(bystander.wait_for, 2)) == 2
        if how == "deleted":
            await unrole(client, revoked)
        elif how == "expired":
            await expire(client, watcher, revoked, "customer", lost.customer)
        else:  # the same role now on the kept customer
            await put(
                client,
                f"/roles/{revoked}/",
                {
                    "user_uuid": watcher.uuid.hex,
                    "role_name": "customer.member",
                    "scope": {"type": "customer", "uuid": kept.customer.hex},
                },
            )
        # The agent was disconnected so its unacked copy came back to be judged; the other
        # consumer, whose queue held nothing to remove, was left alone.
        assert await asyncio.to_thread(agent.wait_refused)
        assert bystander.connection.is_connected()
    finally:
        await asyncio.to_thread(agent.close)
        await asyncio.to_thread(bystander.close)
    wanted = [event_id for kind, event_id in events if kind == "kept"]
    await swept(settings)
    assert await read_all(watcher, mine, len(wanted)) == wanted


async def test_a_role_that_still_covers_the_copies_removes_nothing(
    backend: Backend, client: httpx.AsyncClient, settings: Settings
) -> None:
    """Two roles reach the same offering (its customer and its project): deleting one leaves
    every copy, and the agent's connection, in place."""
    entities = await tree(client)
    watcher = await backend.put_user()
    by_customer = await role(client, watcher, "customer", entities.customer)
    await role(client, watcher, "project", entities.project)
    mine = await consumer_of(watcher, {"scopes": scopes(("offering", entities.offering))})
    ids = [await sent(client, order_event(entities.offering)) for _ in range(3)]
    agent = await asyncio.to_thread(reader, watcher, mine, prefetch=1)
    try:
        assert len(await asyncio.to_thread(agent.wait_for, 1)) == 1
        await unrole(client, by_customer)
        await swept(settings)
        assert not await asyncio.to_thread(agent.wait_refused, 1.0)
    finally:
        await asyncio.to_thread(agent.close)
    assert await read_all(watcher, mine, 3) == ids
