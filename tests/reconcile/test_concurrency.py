"""Reconcile racing registrations, another run, and a broker refusing one item."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient, QueuePage
from queuekeeper.common.locks import job_lock
from tests.helpers import Backend, Operator
from tests.reconcile.test_reconcile import SPEC_ARGUMENTS, registered_queue


def state_of(app: FastAPI) -> Runtime:
    state: Runtime = app.state.queuekeeper
    return state


def pause_after(
    target: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Event, asyncio.Event]:
    """Make `target.name` do its work, then signal and wait before returning."""
    original: Callable[..., Awaitable[Any]] = getattr(target, name)
    done, release = asyncio.Event(), asyncio.Event()

    async def paused(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        done.set()
        await asyncio.wait_for(release.wait(), 30)
        return result

    monkeypatch.setattr(target, name, paused)
    return done, release


def signal_listing(
    management: ManagementClient, vhost: str, monkeypatch: pytest.MonkeyPatch
) -> asyncio.Event:
    original = management.list_queues_page
    listed = asyncio.Event()

    async def watched(listed_vhost: str, **kwargs: Any) -> QueuePage:
        result = await original(listed_vhost, **kwargs)
        if listed_vhost == vhost:
            listed.set()
        return result

    monkeypatch.setattr(management, "list_queues_page", watched)
    return listed


async def test_queue_registered_during_a_run_is_never_deleted(
    app: FastAPI,
    backend: Backend,
    operator: Operator,
    management: ManagementClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = state_of(app)
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    name = topology.queue_name(uuid.UUID(subscription["uuid"]), offering, "order")
    # create_queue declares the broker queue, then stops before committing its row.
    declared, release = pause_after(state.provisioner, "ensure_queue", monkeypatch)
    registering = asyncio.create_task(agent.create_queue(subscription["uuid"], offering))
    await asyncio.wait_for(declared.wait(), 10)
    assert await management.get_queue(agent.vhost, name) is not None  # on the broker, no row

    listed = signal_listing(state.management, agent.vhost, monkeypatch)
    reconciling = asyncio.create_task(operator.reconcile())
    await asyncio.wait_for(listed.wait(), 10)
    # The run saw a `subscription_*` queue without a row: an orphan, by appearance. It
    # must now wait for the registration instead of deleting the queue.
    await asyncio.sleep(0.5)
    assert not reconciling.done()
    assert await management.get_queue(agent.vhost, name) is not None

    release.set()
    response = await registering
    run = await reconciling
    assert response.status_code == 201, response.text
    assert await management.get_queue(agent.vhost, name) is not None
    assert "orphans_deleted" not in run["changed"]
    assert run["found"]["orphans_registered_meanwhile"] == 1


@pytest.mark.settings(reconcile_max_delete_share=1.0)  # deletion mechanics, not the guard
async def test_vhost_gaining_a_subscription_during_a_run_is_kept(
    app: FastAPI,
    backend: Backend,
    operator: Operator,
    management: ManagementClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = state_of(app)
    agent, offering = await backend.agent_with_offering()
    # The user's vhost exists (ours) but no subscription uses it: reconcile would remove it.
    await state.provisioner.ensure_vhost(agent.vhost)
    created_user, release = pause_after(state.provisioner, "ensure_subscription_user", monkeypatch)
    subscribing = asyncio.create_task(
        agent.client.post("/api/event-subscriptions/", json={}, headers=agent.headers)
    )
    await asyncio.wait_for(created_user.wait(), 10)

    reconciling = asyncio.create_task(operator.reconcile())
    await asyncio.sleep(0.5)
    assert not reconciling.done()  # waiting for the subscription to be committed

    release.set()
    response = await subscribing
    run = await reconciling
    assert response.status_code == 201, response.text
    assert await management.get_vhost(agent.vhost) is not None
    assert await management.get_user(response.json()["uuid"]) is not None
    assert "vhosts_deleted" not in run["changed"]
    assert "users_deleted" not in run["changed"]
    # And the subscription works: its queue can be registered.
    registered = await agent.create_queue(response.json()["uuid"], offering)
    assert registered.status_code == 201, registered.text


async def test_second_concurrent_run_skips_while_the_lock_is_held(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, _ = await registered_queue(backend)
    orphan = topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "order")
    await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)
    # Another replica is in the middle of a reconcile: it holds the job's advisory lock.
    async with job_lock(state_of(app).engine, "reconcile") as acquired:
        assert acquired
        response = await operator.client.post("/api/admin/reconcile/", headers=operator.headers)
    assert response.status_code == 409, response.text
    body = response.json()
    assert "already in progress" in body["detail"]
    assert body["run"]["status"] == "skipped"
    assert await management.get_queue(agent.vhost, orphan) is not None  # it did nothing
    runs = await operator.get("/api/admin/reconcile-runs/", status="skipped")
    assert [run["uuid"] for run in runs] == [body["run"]["uuid"]]
    # With the lock free again, the next run does the work.
    run = await operator.reconcile()
    assert run["changed"] == {"orphans_deleted": 1}


async def test_a_run_asked_for_while_one_is_going_skips(
    app: FastAPI, backend: Backend, operator: Operator, monkeypatch: pytest.MonkeyPatch
) -> None:
    await registered_queue(backend)
    # The first run stops right after its first broker call, holding the job's lock.
    started, release = pause_after(state_of(app).management, "list_vhosts", monkeypatch)
    first = asyncio.create_task(
        operator.client.post("/api/admin/reconcile/", headers=operator.headers)
    )
    await asyncio.wait_for(started.wait(), 10)
    second = await operator.client.post("/api/admin/reconcile/", headers=operator.headers)
    release.set()
    assert second.status_code == 409, second.text
    assert (await first).status_code == 200
    statuses = [run["status"] for run in await operator.get("/api/admin/reconcile-runs/")]
    assert sorted(statuses) == ["skipped", "succeeded"]


@pytest.mark.settings(reconcile_max_delete_share=1.0)  # deletion mechanics, not the guard
async def test_one_failing_delete_does_not_stop_the_run_and_is_recorded(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, _ = await registered_queue(backend)
    orphans = sorted(
        topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "order")
        for _ in range(3)
    )
    for orphan in orphans:
        await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)
    refused = orphans[1]
    with respx.mock(assert_all_called=True) as mock:
        mock.route(method="DELETE", path__regex=rf"/api/queues/{agent.vhost}/{refused}$").respond(
            400, json={"error": "bad_request", "reason": "simulated refusal for this queue"}
        )
        mock.route().pass_through()
        run = await operator.reconcile()

    assert run["status"] == "partial"
    assert run["changed"] == {"orphans_deleted": 2}
    [failure] = run["failures"]
    assert failure["item"] == f"{agent.vhost}/{refused}"
    assert "simulated refusal for this queue" in failure["reason"]
    assert await management.get_queue(agent.vhost, refused) is not None
    assert await management.get_queue(agent.vhost, orphans[0]) is None
    assert await management.get_queue(agent.vhost, orphans[2]) is None


async def test_broker_unreachable_run_fails_with_503_and_is_recorded(
    app: FastAPI, backend: Backend, operator: Operator
) -> None:
    await registered_queue(backend)
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="127.0.0.1", port=15672).mock(
            side_effect=httpx.ConnectError("connection refused")
        )
        response = await operator.client.post("/api/admin/reconcile/", headers=operator.headers)
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == "7"
    body = response.json()
    assert body["run"]["status"] == "failed"
    assert "unreachable" in body["detail"]
    runs = await operator.get("/api/admin/reconcile-runs/")
    assert runs[0]["uuid"] == body["run"]["uuid"]
    assert runs[0]["status"] == "failed"
