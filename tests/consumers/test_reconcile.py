"""Reconcile, stale cleanup and the admin queue view cover consumers as they cover
subscription queues (contract §9), with the same race-freedom."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fastapi import FastAPI

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from tests.consumers.test_register_queue import QUEUE_ARGUMENTS, new_identity, register_queue
from tests.helpers import Agent, Backend, Operator
from tests.reconcile.test_concurrency import pause_after, signal_listing, state_of


async def consumer_of(backend: Backend) -> tuple[Agent, dict[str, str]]:
    agent, offering = await backend.agent_with_offering()
    response = await register_queue(agent, await new_identity(agent, offering))
    assert response.status_code == 201, response.text
    answer: dict[str, str] = response.json()
    return agent, answer


async def test_reconcile_restores_a_consumers_queue_user_and_permissions(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, answer = await consumer_of(backend)
    vhost, queue, user = agent.vhost, answer["queue_name"], answer["rmq_username"]
    # Everything a consumer needs, broken by hand, and an orphan consumer queue beside it.
    await management.delete_queue(vhost, queue)
    await management.delete_user(user)
    orphan = f"consumer_{uuid.uuid4().hex}"
    await management.put_queue(vhost, orphan, arguments={})

    dry = await operator.reconcile(dry_run=True)
    assert dry["changed"] == {}
    assert await management.get_queue(vhost, orphan) is not None

    run = await operator.reconcile()
    assert run["status"] == "succeeded", run
    assert run["changed"]["orphans_deleted"] == 1
    assert run["changed"]["queues_recreated"] == 1
    assert run["changed"]["users_restored"] == 1
    assert await management.get_queue(vhost, orphan) is None
    restored = await management.get_queue(vhost, queue)
    assert restored is not None
    assert restored.arguments == QUEUE_ARGUMENTS
    assert await management.get_user(user) is not None
    permissions = await management.get_permissions(vhost, user)
    assert permissions is not None
    assert permissions.read == f"^{queue}$"

    # Drift: wider permissions and a queue re-made with other arguments while empty.
    await management.put_permissions(vhost, user, topology.SERVICE_PERMISSIONS)
    await management.delete_queue(vhost, queue)
    await management.put_queue(vhost, queue, arguments={"x-max-length": 5})
    run = await operator.reconcile()
    assert run["changed"]["permissions_restored"] == 1
    assert run["changed"]["drift_repaired"] == 1
    permissions = await management.get_permissions(vhost, user)
    assert permissions is not None
    assert (permissions.configure, permissions.write) == ("^$", "^$")
    assert getattr(await management.get_queue(vhost, queue), "arguments", None) == QUEUE_ARGUMENTS

    # A consumer-like broker user of ours that no consumer owns is removed.
    stray = uuid.uuid4()
    await state_of(app).provisioner.ensure_consumer_user(vhost, stray, None)
    run = await operator.reconcile()
    assert run["changed"]["users_deleted"] == 1
    assert await management.get_user(stray.hex) is None
    assert await management.get_user(user) is not None  # the consumer's own stays
    again = await operator.reconcile()
    assert again["changed"] == {}, again


async def test_consumer_registered_during_a_run_is_never_deleted(
    app: FastAPI,
    backend: Backend,
    operator: Operator,
    management: ManagementClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = state_of(app)
    agent, offering = await backend.agent_with_offering()
    await agent.create_subscription()  # the vhost is in use, so reconcile lists its queues
    identity = await new_identity(agent, offering)
    # register_queue makes its queue and broker user, then stops before committing its row.
    declared, release = pause_after(state.provisioner, "ensure_queue", monkeypatch)
    registering = asyncio.create_task(register_queue(agent, identity))
    await asyncio.wait_for(declared.wait(), 10)
    page = await management.list_queues_page(agent.vhost, page=1, page_size=100)
    (name,) = [q.name for q in page.items if q.name.startswith("consumer_")]

    listed = signal_listing(state.management, agent.vhost, monkeypatch)
    reconciling = asyncio.create_task(operator.reconcile())
    await asyncio.wait_for(listed.wait(), 10)
    # The run saw a `consumer_*` queue without a row: an orphan by appearance. It must wait
    # for the registration instead of deleting the queue.
    await asyncio.sleep(0.5)
    assert not reconciling.done()
    assert await management.get_queue(agent.vhost, name) is not None

    release.set()
    response = await registering
    run = await reconciling
    assert response.status_code == 201, response.text
    assert response.json()["queue_name"] == name
    assert await management.get_queue(agent.vhost, name) is not None
    assert await management.get_user(response.json()["rmq_username"]) is not None
    assert "orphans_deleted" not in run["changed"]
    assert "users_deleted" not in run["changed"]
    assert run["found"]["orphans_registered_meanwhile"] == 1


async def test_stale_cleanup_removes_a_deactivated_users_consumers(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, answer = await consumer_of(backend)
    await backend.put_user(agent.uuid, is_active=False)
    run = await operator.cleanup_stale()
    assert run["changed"]["consumers_removed"] == 1
    assert await management.get_queue(agent.vhost, answer["queue_name"]) is None
    assert await management.get_user(answer["rmq_username"]) is None
    assert await management.get_vhost(agent.vhost) is None


async def test_the_admin_queue_view_lists_consumer_queues(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, answer = await consumer_of(backend)
    orphan = f"consumer_{uuid.uuid4().hex}"
    await management.put_queue(agent.vhost, orphan, arguments={})
    items = await operator.get("/api/admin/queues/", vhost=agent.vhost)
    by_name = {item["queue_name"]: item for item in items}
    mine = by_name[answer["queue_name"]]
    assert (mine["state"], mine["registered"], mine["consumer_uuid"]) == (
        "ok",
        True,
        answer["rmq_username"],
    )
    assert mine["present"] is True
    assert mine["arguments_ok"] is True
    stray = by_name[orphan]
    assert (stray["state"], stray["registered"]) == ("unregistered", False)


async def test_the_identities_overview_shows_each_consumer_with_its_queue(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, answer = await consumer_of(backend)
    (listed,) = await operator.get("/api/admin/agent-identities/", user_uuid=agent.uuid.hex)
    assert listed["subscriptions"] == []
    consumer = listed["consumer"]
    assert consumer["queue_name"] == answer["queue_name"]
    assert consumer["rmq_username"] == answer["rmq_username"]
    assert (consumer["present"], consumer["arguments_ok"], consumer["differences"]) == (
        True,
        True,
        [],
    )
    assert consumer["consumers"] == 0  # nobody reads it yet
    # Drifted on the broker: the overview says how.
    await management.delete_queue(agent.vhost, answer["queue_name"])
    await management.put_queue(agent.vhost, answer["queue_name"], arguments={"x-max-length": 5})
    (listed,) = await operator.get("/api/admin/agent-identities/", user_uuid=agent.uuid.hex)
    assert listed["consumer"]["arguments_ok"] is False
    assert any("x-max-length" in d for d in listed["consumer"]["differences"])
    (quiet,) = await operator.get(
        "/api/admin/agent-identities/", user_uuid=agent.uuid.hex, broker="false"
    )
    assert (quiet["consumer"]["present"], quiet["consumer"]["messages"]) == (None, None)
