"""Webhook consumers' API (contract §13): registration, update, deletion, the answers and
the list filter. Every URL here points at 127.0.0.1 (allowed by the settings for the test)
or at a name under `.invalid`, which never resolves: nothing connects anywhere."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, update
from structlog.testing import capture_logs

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient
from queuekeeper.jobs.runs import Job, Trigger
from queuekeeper.models import EventConsumer, QueuePresence, utcnow
from queuekeeper.webhooks.urls import MAX_URL_LENGTH
from tests.consumers.scopes import SERVICE, scopes, staff, tree
from tests.consumers.test_event_consumers_api import CONSUMERS, EVENT_CONSUMER_KEYS
from tests.helpers import Agent, Backend, Operator

REGISTER = f"{CONSUMERS}register_webhook/"
# A credential in the query: it must never come back.
URL = "http://127.0.0.1:9/hooks/waldur?key=s3cret-credential"
LOOPBACK = pytest.mark.settings(webhook_allowed_networks=["127.0.0.0/8"])


async def register_webhook(
    who: Agent | None, body: dict[str, Any], client: httpx.AsyncClient | None = None
) -> httpx.Response:
    if who is None:
        assert client is not None
        return await client.post(REGISTER, json=body, headers=SERVICE)
    return await who.client.post(REGISTER, json=body, headers=who.headers)


def never_shows_the_url(text: str) -> None:
    assert "s3cret-credential" not in text
    assert "/hooks/waldur" not in text


@LOOPBACK
async def test_register_a_global_webhook_consumer(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    admin = await staff(backend)
    with capture_logs() as logs:
        made = await register_webhook(admin, {"webhook_url": URL, "object_types": ["user_role"]})
    assert made.status_code == 201, made.text
    answer = made.json()
    assert set(answer) >= EVENT_CONSUMER_KEYS
    assert answer["delivery"] == "webhook"
    assert answer["webhook_destination"] == "http://127.0.0.1:9"
    assert answer["is_global"] is True
    assert answer["scopes"] == []
    assert answer["queue_created"] is False
    assert answer["rmq_username"] == ""
    assert (answer["last_error"], answer["last_error_at"], answer["last_delivered_at"]) == (
        "",
        None,
        None,
    )
    secret = answer["webhook_secret"]
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret[6:])) >= 24
    never_shows_the_url(made.text)
    never_shows_the_url(repr(logs))

    # Nothing on the broker: no vhost, no queue, no user.
    assert await management.get_vhost(admin.vhost) is None
    assert await management.get_user(answer["uuid"]) is None

    # The secret is shown once; the URL never.
    path = f"{CONSUMERS}{answer['uuid']}/"
    for read in (
        await client.get(path, headers=admin.headers),
        await client.get(CONSUMERS, headers=admin.headers),
        await client.get(CONSUMERS, headers=SERVICE),
        await client.get(f"{path}status/", headers=admin.headers),
    ):
        assert read.status_code == 200, read.text
        assert "webhook_secret" not in read.text
        assert secret not in read.text
        never_shows_the_url(read.text)
    one = (await client.get(path, headers=admin.headers)).json()
    assert one["webhook_destination"] == "http://127.0.0.1:9"
    assert one["delivery"] == "webhook"

    # Not idempotent: a repeat is another consumer with another secret.
    again = await register_webhook(admin, {"webhook_url": URL, "object_types": ["user_role"]})
    assert again.status_code == 201
    assert again.json()["uuid"] != answer["uuid"]
    assert again.json()["webhook_secret"] != secret


@LOOPBACK
async def test_the_service_token_registers_for_a_staff_or_support_user(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    support = await staff(backend, is_support=True)
    made = await register_webhook(None, {"webhook_url": URL, "user_uuid": support.uuid.hex}, client)
    assert made.status_code == 201, made.text
    assert made.json()["user_uuid"] == support.uuid.hex
    assert made.json()["authorized_via"] == "staff"
    assert made.json()["auth_token_prefix"] == ""

    missing = await register_webhook(None, {"webhook_url": URL}, client)
    assert missing.status_code == 400
    assert missing.json()["errors"][0]["field"] == "user_uuid"
    ordinary = await backend.put_user()
    refused = await register_webhook(
        None, {"webhook_url": URL, "user_uuid": ordinary.uuid.hex}, client
    )
    assert refused.status_code == 403
    assert "neither a staff nor a support user" in refused.text
    unknown = await register_webhook(
        None, {"webhook_url": URL, "user_uuid": uuid.uuid4().hex}, client
    )
    assert unknown.status_code == 400
    assert unknown.json()["errors"][0]["field"] == "user_uuid"


@LOOPBACK
async def test_ordinary_users_are_refused(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering = await backend.agent_with_offering()
    refused = await register_webhook(
        agent, {"webhook_url": URL, "scopes": scopes(("offering", offering))}
    )
    assert refused.status_code == 403, refused.text
    assert "Only staff and support users" in refused.json()["detail"]
    listed = await client.get(CONSUMERS, headers=SERVICE)
    assert listed.json() == []


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://127.0.0.1/x", "must be an http or https URL"),
        ("127.0.0.1:9/x", "must be an http or https URL"),
        ("http://127.0.0.1:9/" + "a" * MAX_URL_LENGTH, "longer than 2048 characters"),
        ("http://127.0.0.1:9/x#part", "has a fragment"),
        ("http:///path-only", "has no host"),
        ("http://127.0.0.1:99999/", "is not a valid URL"),
        ("http://hooks.example.invalid/x", "does not resolve"),
        # No allowed networks (the default): loopback is refused.
        ("http://127.0.0.1:9/x", "127.0.0.1 is a loopback address"),
        ("http://[::1]:9/x", "::1 is a loopback address"),
        ("http://localhost:9/x", "resolves to"),
    ],
)
async def test_bad_urls_are_refused_naming_the_field(
    backend: Backend, url: str, reason: str
) -> None:
    admin = await staff(backend)
    refused = await register_webhook(admin, {"webhook_url": url})
    assert refused.status_code == 400, refused.text
    error = refused.json()["errors"][0]
    assert error["field"] == "webhook_url"
    assert reason in error["message"]
    assert url not in refused.text


@LOOPBACK
async def test_bindings_are_checked_as_for_queue_consumers(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    admin = await staff(backend)
    place = await tree(client)
    bound = await register_webhook(
        admin, {"webhook_url": URL, "scopes": scopes(("project", place.project))}
    )
    assert bound.status_code == 201, bound.text
    assert bound.json()["scopes"] == [{"type": "project", "uuid": place.project.hex}]
    assert bound.json()["is_global"] is False
    unknown = await register_webhook(
        admin, {"webhook_url": URL, "scopes": scopes(("project", uuid.uuid4()))}
    )
    assert unknown.status_code == 400
    assert unknown.json()["errors"][0]["field"] == "scopes.0.uuid"
    twice = await register_webhook(
        admin,
        {
            "webhook_url": URL,
            "scopes": scopes(("project", place.project), ("project", place.project)),
        },
    )
    assert twice.status_code == 400


@LOOPBACK
async def test_the_delivery_filter_and_delete(backend: Backend, client: httpx.AsyncClient) -> None:
    agent, offering = await backend.agent_with_offering()
    queue = await agent.client.post(
        f"{CONSUMERS}register/",
        json={"scopes": scopes(("offering", offering))},
        headers=agent.headers,
    )
    assert queue.status_code == 201
    admin = await staff(backend)
    hook = (await register_webhook(admin, {"webhook_url": URL})).json()
    for delivery, expected in (
        ("rmq", queue.json()["queue_name"]),
        ("webhook", hook["queue_name"]),
    ):
        listed = await client.get(CONSUMERS, params={"delivery": delivery}, headers=SERVICE)
        assert [row["queue_name"] for row in listed.json()] == [expected]
        counted = await client.head(CONSUMERS, params={"delivery": delivery}, headers=SERVICE)
        assert counted.headers["X-Result-Count"] == "1"

    gone = await client.delete(f"{CONSUMERS}{hook['uuid']}/", headers=admin.headers)
    assert gone.status_code == 204
    listed = await client.get(CONSUMERS, params={"delivery": "webhook"}, headers=SERVICE)
    assert listed.json() == []


@LOOPBACK
async def test_update_webhook(app: FastAPI, backend: Backend, client: httpx.AsyncClient) -> None:
    admin = await staff(backend)
    place, elsewhere = await tree(client), await tree(client)
    made = await register_webhook(
        admin, {"webhook_url": URL, "scopes": scopes(("project", place.project))}
    )
    hook = made.json()
    path = f"{CONSUMERS}{hook['uuid']}/update_webhook/"
    state: Runtime = app.state.queuekeeper
    async with state.sessions() as session:
        await session.execute(
            update(EventConsumer)
            .where(EventConsumer.uuid == uuid.UUID(hook["uuid"]))
            .values(webhook_gone_at=utcnow(), webhook_failing_since=utcnow())
        )
        await session.commit()
    gone = (await client.get(f"{CONSUMERS}{hook['uuid']}/", headers=admin.headers)).json()
    assert gone["delivery_blocked_reason"] == "webhook_gone"
    status = (await client.get(f"{CONSUMERS}{hook['uuid']}/status/", headers=admin.headers)).json()
    assert status["delivery_blocked_reason"] == "webhook_gone"
    assert "update_webhook" in status["delivery_blocked_detail"]

    moved = await client.post(
        path,
        json={
            "webhook_url": "http://127.0.0.1:8/v2?token=other-credential",
            "object_types": ["user_role"],
            "payload_filters": {"scope_type": ["project"]},
            "scopes": scopes(("project", elsewhere.project)),
        },
        headers=admin.headers,
    )
    assert moved.status_code == 200, moved.text
    answer = moved.json()
    assert answer["webhook_destination"] == "http://127.0.0.1:8"
    assert "other-credential" not in moved.text
    assert "webhook_secret" not in answer
    assert answer["object_types"] == ["user_role"]
    assert answer["payload_filters"] == {"scope_type": ["project"]}
    assert answer["scopes"] == [{"type": "project", "uuid": elsewhere.project.hex}]
    # The update cleared webhook_gone and webhook_failing: the next attempt tells.
    assert answer["delivery_blocked_reason"] is None

    # Omitted fields stay; the same bindings again, or one more, keep the ones held.
    kept = await client.post(path, json={}, headers=admin.headers)
    assert kept.status_code == 200
    assert kept.json()["scopes"] == answer["scopes"]
    assert kept.json()["webhook_destination"] == "http://127.0.0.1:8"
    both = scopes(("project", elsewhere.project), ("offering", elsewhere.offering))
    grown = await client.post(path, json={"scopes": both}, headers=admin.headers)
    assert grown.status_code == 200, grown.text
    assert len(grown.json()["scopes"]) == 2
    same = await client.post(path, json={"scopes": both[::-1]}, headers=admin.headers)
    assert same.status_code == 200, same.text
    assert same.json()["scopes"] == grown.json()["scopes"]

    bad = await client.post(path, json={"webhook_url": "http://x.invalid/"}, headers=admin.headers)
    assert bad.status_code == 400
    assert bad.json()["errors"][0]["field"] == "webhook_url"
    ordinary = await backend.put_user()
    refused = await client.post(path, json={}, headers=ordinary.headers)
    assert refused.status_code == 403
    unknown = await client.post(
        f"{CONSUMERS}{uuid.uuid4().hex}/update_webhook/", json={}, headers=SERVICE
    )
    assert unknown.status_code == 404

    agent, offering = await backend.agent_with_offering()
    queue = await agent.client.post(
        f"{CONSUMERS}register/",
        json={"scopes": scopes(("offering", offering))},
        headers=agent.headers,
    )
    not_a_webhook = await client.post(
        f"{CONSUMERS}{queue.json()['rmq_username']}/update_webhook/", json={}, headers=SERVICE
    )
    assert not_a_webhook.status_code == 400
    assert not_a_webhook.json()["errors"][0]["field"] == "delivery"


@LOOPBACK
async def test_reconcile_and_presence_leave_webhook_consumers_alone(
    app: FastAPI,
    backend: Backend,
    client: httpx.AsyncClient,
    operator: Operator,
    management: ManagementClient,
) -> None:
    admin = await staff(backend)
    hook = (await register_webhook(admin, {"webhook_url": URL})).json()
    report = await operator.reconcile()
    assert hook["queue_name"] not in repr(report)
    assert await management.get_vhost(admin.vhost) is None
    assert await management.get_user(hook["uuid"]) is None
    state: Runtime = app.state.queuekeeper
    await state.jobs.run(Job.PRESENCE, Trigger.API)
    async with state.sessions() as session:
        seen = await session.scalar(
            select(QueuePresence).where(QueuePresence.queue_name == hook["queue_name"])
        )
    assert seen is None
    status = await client.get(f"{CONSUMERS}{hook['uuid']}/status/", headers=SERVICE)
    assert status.status_code == 200
    answer = status.json()
    assert answer["delivery_blocked_reason"] is None
    assert (answer["pending"], answer["oldest_pending_at"], answer["next_attempt_at"]) == (
        0,
        None,
        None,
    )
    assert answer["connected"] is None


@LOOPBACK
async def test_stale_cleanup_of_a_webhook_owner_plans_and_touches_no_broker_user(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    admin = await staff(backend)
    hook = (await register_webhook(admin, {"webhook_url": URL})).json()
    await backend.put_user(admin.uuid, token=admin.token, is_active=False, is_staff=True)

    planned = await operator.cleanup_stale(dry_run=True)

    assert [(entry["action"], entry["item"]) for entry in planned["actions"]][:1] == [
        ("delete_consumer", f"consumer {hook['uuid']}")
    ]
    assert "delete_user" not in {entry["action"] for entry in planned["actions"]}
    run = await operator.cleanup_stale()
    assert run["changed"].get("consumers_removed") == 1, run
    assert "users_deleted" not in run["changed"]
    assert await management.get_user(hook["uuid"]) is None
