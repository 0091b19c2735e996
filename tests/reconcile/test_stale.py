"""Stale subscriptions (expired tokens, inactive users, deleted users) leave nothing behind."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from fastapi import FastAPI
from sqlalchemy import delete, func, select

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient
from queuekeeper.models import EventSubscription, EventSubscriptionQueue, User
from tests.helpers import Backend, Operator
from tests.reconcile.test_reconcile import registered_queue


def state_of(app: FastAPI) -> Runtime:
    state: Runtime = app.state.queuekeeper
    return state


async def subscriptions_of(app: FastAPI, owner: uuid.UUID) -> int:
    async with state_of(app).sessions() as session:
        count = await session.scalar(
            select(func.count()).where(EventSubscription.user_uuid == owner)
        )
        return int(count or 0)


async def test_expired_and_inactive_users_lose_subscriptions_and_broker_objects(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    expired, expired_subscription, _ = await registered_queue(backend)
    inactive, inactive_subscription, _ = await registered_queue(backend)
    valid, valid_subscription, valid_queue = await registered_queue(backend)
    yesterday = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    await backend.put_user(expired.uuid, token=expired.token, token_expires_at=yesterday)
    await backend.put_user(inactive.uuid, token=inactive.token, is_active=False)
    await backend.put_user(valid.uuid, token=valid.token, token_expires_at=tomorrow)

    run = await operator.cleanup_stale()

    assert run["job"] == "cleanup_stale"
    assert run["status"] == "succeeded", run
    assert run["found"]["stale_users"] == 2
    assert run["changed"] == {"subscriptions_removed": 2, "users_deleted": 2, "vhosts_deleted": 2}
    reasons = {entry["item"]: entry["detail"] for entry in run["actions"]}
    assert "token expired" in reasons[f"subscription {expired_subscription['uuid']}"]
    assert reasons[f"subscription {inactive_subscription['uuid']}"] == "user is inactive"
    for agent, subscription in ((expired, expired_subscription), (inactive, inactive_subscription)):
        assert await subscriptions_of(app, agent.uuid) == 0
        assert await management.get_vhost(agent.vhost) is None  # its queues went with it
        assert await management.get_user(subscription["uuid"]) is None
    async with state_of(app).sessions() as session:
        queues = set(await session.scalars(select(EventSubscriptionQueue.queue_name)))
    assert queues == {valid_queue["queue_name"]}
    # The valid user keeps everything.
    assert await subscriptions_of(app, valid.uuid) == 1
    assert await management.get_queue(valid.vhost, valid_queue["queue_name"]) is not None
    assert await management.get_user(valid_subscription["uuid"]) is not None
    # The users themselves stay (the backend owns them); only their subscriptions go.
    async with state_of(app).sessions() as session:
        assert await session.get(User, expired.uuid) is not None


@pytest.mark.settings(reconcile_max_delete_share=1.0)  # deletion mechanics, not the guard
async def test_deleted_users_broker_leftovers_removed(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    gone, gone_subscription, _ = await registered_queue(backend)
    # The user was deleted while the broker was unreachable: rows gone, broker objects left.
    async with state_of(app).sessions() as session:
        await session.execute(delete(User).where(User.uuid == gone.uuid))
        await session.commit()
    assert await management.get_vhost(gone.vhost) is not None

    run = await operator.cleanup_stale()

    assert run["changed"] == {"vhosts_deleted": 1, "users_deleted": 1}, run
    assert await management.get_vhost(gone.vhost) is None
    assert await management.get_user(gone_subscription["uuid"]) is None


async def test_dry_run_removes_nothing(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, queue = await registered_queue(backend)
    await backend.put_user(agent.uuid, token=agent.token, is_active=False)

    run = await operator.cleanup_stale(dry_run=True)

    assert run["dry_run"] is True
    assert run["changed"] == {}
    assert [(entry["action"], entry["planned"]) for entry in run["actions"]] == [
        ("delete_subscription", True),
        ("delete_user", True),
        ("delete_vhost", True),
    ]
    assert await subscriptions_of(app, agent.uuid) == 1
    assert await management.get_queue(agent.vhost, queue["queue_name"]) is not None
    assert await management.get_user(subscription["uuid"]) is not None


async def test_user_whose_expiry_was_cleared_keeps_everything(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    await backend.put_user(agent.uuid, token=agent.token, token_expires_at=None)
    run = await operator.cleanup_stale()
    assert run["found"].get("stale_users", 0) == 0
    assert await subscriptions_of(app, agent.uuid) == 1
    assert await management.get_queue(agent.vhost, queue["queue_name"]) is not None
