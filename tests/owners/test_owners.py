"""What a registration that never committed leaves on the broker (owners.service.unmake):
taken back, but never what a committed row still uses. Against the real broker."""

from __future__ import annotations

import uuid

from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.owners import service as owners
from tests.helpers import Backend


async def _make_broker_user(state: Runtime, owner: uuid.UUID) -> uuid.UUID:
    """What a registration makes before its row: the vhost and a subscription's user."""
    subscription = uuid.uuid4()
    await state.provisioner.ensure_vhost(topology.vhost_name(owner))
    await state.provisioner.ensure_subscription_user(topology.vhost_name(owner), subscription, None)
    return subscription


async def test_unmake_removes_the_user_and_the_vhost_no_row_uses(
    app: FastAPI, backend: Backend, management: ManagementClient
) -> None:
    agent, _ = await backend.agent_with_offering()
    state: Runtime = app.state.queuekeeper
    subscription = await _make_broker_user(state, agent.uuid)
    assert await management.get_user(topology.subscription_user_name(subscription))

    async with state.sessions() as session:
        await owners.unmake(session, state.provisioner, agent.uuid, subscriptions=[subscription])

    assert await management.get_user(topology.subscription_user_name(subscription)) is None
    assert await management.get_vhost(topology.vhost_name(agent.uuid)) is None


async def test_unmake_keeps_the_vhost_and_users_of_committed_rows(
    app: FastAPI, backend: Backend, management: ManagementClient
) -> None:
    agent, _ = await backend.agent_with_offering()
    committed = uuid.UUID((await agent.create_subscription())["uuid"])
    state: Runtime = app.state.queuekeeper
    abandoned = await _make_broker_user(state, agent.uuid)

    async with state.sessions() as session:
        await owners.unmake(session, state.provisioner, agent.uuid, subscriptions=[abandoned])

    assert await management.get_user(topology.subscription_user_name(abandoned)) is None
    assert await management.get_user(topology.subscription_user_name(committed))
    assert await management.get_vhost(topology.vhost_name(agent.uuid))
