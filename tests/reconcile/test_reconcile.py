"""Reconcile against the real broker: every kind of disagreement, and what it does about it."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import aio_pika
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY
from sqlalchemy import delete, select

from queuekeeper.app import JOBS, Runtime
from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.config import Settings
from queuekeeper.jobs.runs import Job, JobRunner, Trigger
from queuekeeper.models import EventSubscription
from queuekeeper.reconcile.view import QueueFilter, queue_states
from tests.brokers import BROKER
from tests.helpers import Agent, Backend, Operator
from tests.stomp_client import StompConsumer

SPEC_ARGUMENTS = {
    "x-message-ttl": 3_600_000,
    "x-max-length": 10_000,
    "x-overflow": "reject-publish-dlx",
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": "waldur.dlq.messages",
}


def state_of(app: FastAPI) -> Runtime:
    state: Runtime = app.state.queuekeeper
    return state


async def registered_queue(
    backend: Backend, object_type: str = "order"
) -> tuple[Agent, dict[str, Any], dict[str, Any]]:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    response = await agent.create_queue(subscription["uuid"], offering, object_type)
    assert response.status_code == 201, response.text
    return agent, subscription, response.json()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def actions(run: dict[str, Any], action: str) -> list[str]:
    return [entry["item"] for entry in run["actions"] if entry["action"] == action]


async def publish(vhost: str, queue: str, body: bytes = b"{}") -> None:
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue)


async def test_orphan_queue_deleted_registered_and_other_queues_kept(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, queue = await registered_queue(backend)
    orphan = topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "resource")
    await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)
    await management.put_queue(agent.vhost, "someone.elses.queue", arguments={})
    deleted_before = metric("queuekeeper_reconcile_items_total", action="orphans_deleted")
    runs_before = metric("queuekeeper_job_runs_total", job="reconcile", status="succeeded")

    run = await operator.reconcile()

    assert run["status"] == "succeeded", run
    assert run["changed"] == {"orphans_deleted": 1}
    assert metric("queuekeeper_reconcile_items_total", action="orphans_deleted") == (
        deleted_before + 1
    )
    assert metric("queuekeeper_job_runs_total", job="reconcile", status="succeeded") == (
        runs_before + 1
    )
    assert actions(run, "delete_queue") == [f"{agent.vhost}/{orphan}"]
    assert await management.get_queue(agent.vhost, orphan) is None
    assert await management.get_queue(agent.vhost, queue["queue_name"]) is not None
    # Only `subscription_*` queues are queuekeeper's to judge.
    assert await management.get_queue(agent.vhost, "someone.elses.queue") is not None


async def test_second_run_finds_nothing_to_do(backend: Backend, operator: Operator) -> None:
    await registered_queue(backend)
    await registered_queue(backend)
    first = await operator.reconcile()
    assert first["status"] == "succeeded", first
    second = await operator.reconcile()
    assert second["status"] == "succeeded"
    assert second["changed"] == {}
    assert second["actions"] == []
    assert second["found"]["queues"] == 2
    assert second["found"]["subscriptions"] == 2


async def test_foreign_vhosts_are_never_touched(
    backend: Backend, operator: Operator, management: ManagementClient, settings: Settings
) -> None:
    # A vhost of another installation, holding what would be an orphan in ours.
    foreign = f"qkt-foreign-{uuid.uuid4().hex[:12]}"
    stray = f"subscription_{uuid.uuid4().hex}_offering_{uuid.uuid4().hex}_order"
    # One of our users' vhosts, re-tagged by someone else after the fact.
    agent, _, queue = await registered_queue(backend)
    try:
        await management.put_vhost(foreign, description="not ours", tags=["someone-else"])
        await management.put_permissions(foreign, "guest", topology.SERVICE_PERMISSIONS)
        await management.put_queue(foreign, stray, arguments={})
        await management.put_vhost(agent.vhost, description="taken", tags=["someone-else"])
        await management.delete_queue(agent.vhost, queue["queue_name"])

        run = await operator.reconcile()

        assert run["status"] == "partial"
        assert await management.get_queue(foreign, stray) is not None
        assert await management.get_vhost(foreign) is not None
        # Our registered queue is missing there, but the vhost is not ours any more: left alone.
        assert await management.get_queue(agent.vhost, queue["queue_name"]) is None
        [failure] = run["failures"]
        assert failure["item"] == agent.vhost
        assert "not tagged" in failure["reason"]
        assert run["changed"] == {}
    finally:
        await management.delete_vhost(foreign)
        await management.delete_vhost(agent.vhost)


async def test_missing_queue_recreated_with_spec_arguments(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    await management.delete_queue(agent.vhost, queue["queue_name"])

    run = await operator.reconcile()

    assert run["changed"] == {"queues_recreated": 1}, run
    assert run["found"]["queues_missing"] == 1
    info = await management.get_queue(agent.vhost, queue["queue_name"])
    assert info is not None
    assert info.arguments == SPEC_ARGUMENTS
    assert info.durable is True


async def test_drifted_empty_queue_repaired(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    await management.delete_queue(agent.vhost, queue["queue_name"])
    await management.put_queue(agent.vhost, queue["queue_name"], arguments={"x-max-length": 5})

    run = await operator.reconcile()

    assert run["status"] == "succeeded", run
    assert run["changed"] == {"drift_repaired": 1}
    [repair] = [entry for entry in run["actions"] if entry["action"] == "repair_queue"]
    assert "x-max-length: expected 10000, broker has 5" in repair["detail"]
    info = await management.get_queue(agent.vhost, queue["queue_name"])
    assert info is not None
    assert info.arguments == SPEC_ARGUMENTS


async def test_drifted_queue_holding_messages_reported_not_touched(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    name = queue["queue_name"]
    await management.delete_queue(agent.vhost, name)
    await management.put_queue(agent.vhost, name, arguments={"x-max-length": 5})
    await publish(agent.vhost, name, b'{"keep": "me"}')

    run = await operator.reconcile()

    assert run["status"] == "partial"
    [failure] = run["failures"]
    assert failure["item"] == f"{agent.vhost}/{name}"
    assert "drifted" in failure["reason"]
    assert "x-max-length" in failure["reason"]
    assert "not empty" in failure["reason"].lower()  # the broker's own reason
    info = await management.get_queue(agent.vhost, name, columns="arguments,messages_ready")
    assert info is not None
    assert info.arguments == {"x-max-length": 5}
    connection = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        assert declared.declaration_result.message_count == 1


async def test_drifted_queue_with_a_consumer_reported_not_touched(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    name = queue["queue_name"]
    await management.delete_queue(agent.vhost, name)
    await management.put_queue(agent.vhost, name, arguments={})
    connection = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
    async with connection:
        channel = await connection.channel()
        consumer_queue = await channel.get_queue(name, ensure=False)

        async def ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()

        await consumer_queue.consume(ignore)

        run = await operator.reconcile()

        assert run["status"] == "partial"
        [failure] = run["failures"]
        assert failure["item"] == f"{agent.vhost}/{name}"
        assert "in use" in failure["reason"].lower()
        info = await management.get_queue(agent.vhost, name)
        assert info is not None
        assert info.arguments == {}


async def test_deleted_broker_user_restored_and_agent_can_log_in(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, queue = await registered_queue(backend)
    await management.delete_user(subscription["uuid"])

    run = await operator.reconcile()

    assert run["changed"] == {"users_restored": 1}, run
    permissions = await management.get_permissions(agent.vhost, subscription["uuid"])
    assert permissions is not None
    assert permissions.read == f"^subscription_{subscription['uuid']}_.*$"
    assert (permissions.configure, permissions.write) == ("^$", "^$")
    # The agent logs in with its unchanged token and consumes again.
    consumer = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{queue['queue_name']}")
        await publish(agent.vhost, queue["queue_name"], b'{"order_uuid": "x"}')
        received = await asyncio.to_thread(consumer.wait_for, 1)
        assert len(received) == 1
    finally:
        consumer.close()


async def test_changed_password_and_permissions_restored(
    backend: Backend, operator: Operator, management: ManagementClient, settings: Settings
) -> None:
    agent, subscription, _ = await registered_queue(backend)
    await management.put_user(
        subscription["uuid"],
        password_hash=rabbit_password_hash("someone-elses-password"),
        tags=[settings.instance_tag],
    )
    await management.put_permissions(
        agent.vhost, subscription["uuid"], topology.SERVICE_PERMISSIONS
    )

    run = await operator.reconcile()

    assert run["changed"] == {"users_restored": 1, "permissions_restored": 1}, run
    consumer = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    consumer.close()
    permissions = await management.get_permissions(agent.vhost, subscription["uuid"])
    assert permissions is not None
    assert permissions.configure == "^$"


async def test_user_without_token_cannot_be_restored_marks_subscription_broken(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, _ = await registered_queue(backend)
    await backend.put_user(agent.uuid, token=None)  # the backend removed the user's token
    await management.delete_user(subscription["uuid"])

    run = await operator.reconcile()

    assert run["changed"] == {"subscriptions_marked_broken": 1}, run
    assert run["found"]["users_unrestorable"] == 1
    assert await management.get_user(subscription["uuid"]) is None
    async with state_of(app).sessions() as session:
        stored = await session.get(EventSubscription, uuid.UUID(subscription["uuid"]))
        assert stored is not None
        assert stored.broker_state == "broken"

    # Once the owner has a token again, the directory gives the broker user its password
    # back and the next run its permissions: the subscription is usable again.
    await backend.put_user(agent.uuid, token="a-brand-new-token-0123456789")
    run = await operator.reconcile()
    assert run["changed"] == {"permissions_restored": 1}, run
    async with state_of(app).sessions() as session:
        stored = await session.get(EventSubscription, uuid.UUID(subscription["uuid"]))
        assert stored is not None
        assert stored.broker_state == "ok"
    consumer = StompConsumer(agent.vhost, subscription["uuid"], "a-brand-new-token-0123456789")
    await asyncio.to_thread(consumer.connect)
    consumer.close()


@pytest.mark.settings(reconcile_max_delete_share=1.0)  # deletion mechanics, not the guard
async def test_unused_vhost_and_orphan_users_removed(
    app: FastAPI,
    backend: Backend,
    operator: Operator,
    management: ManagementClient,
    settings: Settings,
) -> None:
    agent, subscription, _ = await registered_queue(backend)
    keeper, kept_subscription, _ = await registered_queue(backend)
    # The subscription rows went while the broker was unreachable: everything stayed there.
    async with state_of(app).sessions() as session:
        await session.execute(
            delete(EventSubscription).where(EventSubscription.user_uuid == agent.uuid)
        )
        await session.commit()
    untagged = uuid.uuid4().hex
    await management.put_user(untagged, password_hash=rabbit_password_hash("x"), tags=["other"])
    try:
        run = await operator.reconcile()

        assert run["changed"] == {"vhosts_deleted": 1, "users_deleted": 1}, run
        assert await management.get_vhost(agent.vhost) is None
        assert await management.get_user(subscription["uuid"]) is None
        # Another user's vhost and broker user, and an untagged user, are not touched.
        assert await management.get_vhost(keeper.vhost) is not None
        assert await management.get_user(kept_subscription["uuid"]) is not None
        assert await management.get_user(untagged) is not None
    finally:
        await management.delete_user(untagged)


async def test_vhost_setup_ensured(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, _ = await registered_queue(backend)
    await management.delete_queue(agent.vhost, "waldur.dlq.messages")
    await management.put_permissions(agent.vhost, "guest", topology.Permissions("^$", "^$", "^$"))

    run = await operator.reconcile()

    assert run["changed"] == {"dead_letter_queues_ensured": 1, "permissions_restored": 1}, run
    dlq = await management.get_queue(agent.vhost, "waldur.dlq.messages")
    assert dlq is not None
    assert dlq.arguments["x-overflow"] == "drop-head"
    permissions = await management.get_permissions(agent.vhost, "guest")
    assert permissions is not None
    assert permissions.configure == ".*"


async def test_missing_vhost_recreated_with_its_queues_and_users(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, queue = await registered_queue(backend)
    await management.delete_vhost(agent.vhost)

    run = await operator.reconcile()

    assert run["status"] == "succeeded", run
    assert run["changed"]["vhosts_created"] == 1
    assert run["changed"]["queues_recreated"] == 1
    assert run["changed"]["permissions_restored"] == 1
    assert await management.get_queue(agent.vhost, queue["queue_name"]) is not None
    assert await management.get_queue(agent.vhost, "waldur.dlq.messages") is not None
    assert await management.get_permissions(agent.vhost, subscription["uuid"]) is not None


async def test_dry_run_reports_everything_and_changes_nothing(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, queue = await registered_queue(backend)
    other, _, drifted = await registered_queue(backend, "resource")
    orphan = topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "order")
    await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)
    await management.delete_queue(agent.vhost, queue["queue_name"])
    await management.delete_queue(other.vhost, drifted["queue_name"])
    await management.put_queue(other.vhost, drifted["queue_name"], arguments={})
    await management.delete_user(subscription["uuid"])

    run = await operator.reconcile(dry_run=True)

    assert run["dry_run"] is True
    assert run["status"] == "succeeded"
    assert run["changed"] == {}
    planned = {(entry["action"], entry["item"]) for entry in run["actions"]}
    assert planned == {
        ("delete_queue", f"{agent.vhost}/{orphan}"),
        ("create_queue", f"{agent.vhost}/{queue['queue_name']}"),
        ("repair_queue", f"{other.vhost}/{drifted['queue_name']}"),
        ("restore_user", f"broker user {subscription['uuid']}"),
    }
    assert all(entry["planned"] for entry in run["actions"])
    # Nothing changed on the broker.
    assert await management.get_queue(agent.vhost, orphan) is not None
    assert await management.get_queue(agent.vhost, queue["queue_name"]) is None
    info = await management.get_queue(other.vhost, drifted["queue_name"])
    assert info is not None
    assert info.arguments == {}
    assert await management.get_user(subscription["uuid"]) is None
    # The dry run is on record, as such.
    runs = await operator.get("/api/admin/reconcile-runs/")
    assert runs[0]["uuid"] == run["uuid"]
    assert runs[0]["dry_run"] is True


async def test_run_records_listed_newest_first_and_fetched_by_uuid(
    backend: Backend, operator: Operator, app: FastAPI
) -> None:
    first = await operator.reconcile(dry_run=True)
    second = await operator.reconcile()
    runs = await operator.get("/api/admin/reconcile-runs/")
    assert [run["uuid"] for run in runs] == [second["uuid"], first["uuid"]]
    assert runs[0]["job"] == "reconcile"
    assert runs[0]["trigger"] == "api"
    assert runs[0]["finished"] is not None
    one = await operator.get(f"/api/admin/reconcile-runs/{first['uuid']}/")
    assert one == first
    assert await operator.get("/api/admin/reconcile-runs/", job="cleanup_stale") == []
    async with state_of(app).sessions() as session:
        assert len(list(await session.scalars(select(EventSubscription)))) == 0


@pytest.mark.settings(reconcile_max_delete_share=1.0)  # deletion mechanics, not the guard
async def test_many_small_pages_join_exactly(
    app: FastAPI, backend: Backend, management: ManagementClient
) -> None:
    """Pages of two queues: every queue is seen once, across page and chunk boundaries."""
    context = state_of(app).jobs.context
    context = dataclasses.replace(
        context, settings=context.settings.model_copy(update={"reconcile_page_size": 2})
    )
    jobs = JobRunner(context, JOBS)
    agent, offering = await backend.agent_with_offering()
    names = []
    for _ in range(2):
        subscription = await agent.create_subscription()
        for object_type in ("order", "resource", "user_role"):
            response = await agent.create_queue(subscription["uuid"], offering, object_type)
            assert response.status_code == 201
            names.append(response.json()["queue_name"])
    names.sort()
    orphans = sorted(
        topology.queue_name(uuid.UUID(hex=name[13:45]), uuid.uuid4(), "order") for name in names[:3]
    )
    for orphan in orphans:
        await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)
    for missing in (names[0], names[3], names[5]):  # first, middle and last by name
        await management.delete_queue(agent.vhost, missing)

    record = await jobs.run(Job.RECONCILE, Trigger.API)

    assert record.status == "succeeded", record.failures
    assert record.changed == {"orphans_deleted": 3, "queues_recreated": 3}
    assert record.found["queues"] == 3
    entries = [entry async for entry in queue_states(context, QueueFilter(vhost=agent.vhost))]
    assert [entry.queue_name for entry in entries] == names
    assert {entry.state for entry in entries} == {"ok"}
    again = await jobs.run(Job.RECONCILE, Trigger.API)
    assert again.changed == {}


@pytest.mark.settings(reconcile_delete_concurrency=3, reconcile_max_delete_share=1.0)
async def test_orphans_are_deleted_a_few_at_a_time(
    app: FastAPI, backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, _queue = await registered_queue(backend)
    orphans = [
        topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "resource")
        for _ in range(9)
    ]
    for orphan in orphans:
        await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)
    provisioner = state_of(app).jobs.context.provisioner
    real_delete = provisioner.delete_queue
    running, most = 0, 0

    async def delete_queue(vhost: str, name: str) -> bool:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await asyncio.sleep(0.05)  # a slow broker: the deletes overlap if allowed to
            return await real_delete(vhost, name)
        finally:
            running -= 1

    provisioner.delete_queue = delete_queue  # type: ignore[method-assign]
    run = await operator.reconcile()

    assert run["changed"] == {"orphans_deleted": 9}
    assert most == 3  # overlapping, but never more than reconcile_delete_concurrency
    for orphan in orphans:
        assert await management.get_queue(agent.vhost, orphan) is None
