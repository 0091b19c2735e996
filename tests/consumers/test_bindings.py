"""Bindings of every scope at registration (contract §12): offerings, projects, customers,
users and global, with who may hold which, idempotent per (owner, binding set), the consumer
and its bindings in one transaction; offering-bound consumers unchanged."""

from __future__ import annotations

import uuid
from datetime import timedelta

import httpx
from fastapi import FastAPI
from sqlalchemy import func, select

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient
from queuekeeper.models import EventConsumer, EventConsumerBinding, utcnow
from tests.consumers.scopes import customer, project, role, scopes, staff, tree, unrole
from tests.consumers.test_event_consumers_api import CONSUMERS, SERVICE, register
from tests.helpers import Backend


async def test_a_role_on_an_entity_or_an_ancestor_lets_a_user_bind_it(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent = await backend.put_user()
    entities = await tree(client)
    other_project = await project(client, entities.customer)
    await role(client, agent, "customer", entities.customer)
    # A customer role covers the customer, its projects and its offerings; and the user
    # itself is always allowed.
    body = {
        "object_types": ["user_role"],
        "scopes": scopes(
            ("customer", entities.customer),
            ("project", other_project),
            ("offering", entities.offering),
            ("user", agent.uuid),
        ),
        "payload_filters": {"action": ["create"]},
    }
    made = await register(agent, body)
    assert made.status_code == 201, made.text
    assert made.json()["payload_filters"] == {"action": ["create"]}
    (listed,) = (await client.get(CONSUMERS, headers=agent.headers)).json()
    assert listed["scopes"] == sorted(body["scopes"], key=lambda s: (s["type"], s["uuid"]))
    assert (listed["is_global"], listed["delivery_blocked_reason"]) == (False, None)
    # The same set in another order: the same consumer; payload filters omitted: kept.
    again = await register(agent, {"scopes": body["scopes"][::-1]})
    assert again.status_code == 200
    assert again.json()["queue_name"] == made.json()["queue_name"]
    assert again.json()["payload_filters"] == {"action": ["create"]}
    # A project role covers the project and its offerings, not the customer.
    member = await backend.put_user()
    await role(client, member, "project", entities.project)
    assert (
        await register(member, {"scopes": scopes(("project", entities.project))})
    ).status_code == 201
    assert (
        await register(member, {"scopes": scopes(("offering", entities.offering))})
    ).status_code == 201
    refused = await register(member, {"scopes": scopes(("customer", entities.customer))})
    assert refused.status_code == 403
    assert entities.customer.hex in refused.json()["detail"]


async def test_refused_bindings_are_403s_naming_them_and_nothing_is_made(
    backend: Backend, client: httpx.AsyncClient, management: ManagementClient
) -> None:
    agent = await backend.put_user()
    entities = await tree(client)
    stranger = await backend.put_user()
    expired = await customer(client)
    await role(client, agent, "customer", expired, expires_at=utcnow() - timedelta(seconds=1))
    own_customer = await customer(client)
    await role(client, agent, "customer", own_customer)
    for body, named in (
        ({"scopes": scopes(("customer", entities.customer))}, entities.customer.hex),
        ({"scopes": scopes(("project", entities.project))}, entities.project.hex),
        ({"scopes": scopes(("offering", entities.offering))}, entities.offering.hex),
        ({"scopes": scopes(("user", stranger.uuid))}, stranger.uuid.hex),
        ({"scopes": scopes(("customer", expired))}, expired.hex),  # the role expired
        # One refused binding refuses the registration.
        (
            {"scopes": scopes(("customer", own_customer), ("customer", entities.customer))},
            entities.customer.hex,
        ),
        ({"scopes": []}, "global"),
    ):
        response = await register(agent, body)
        assert response.status_code == 403, (body, response.text)
        assert named in response.json()["detail"], response.json()
    assert (await client.get(CONSUMERS, headers=agent.headers)).json() == []
    assert await management.get_vhost(agent.vhost) is None


async def test_bad_bindings_are_400s(backend: Backend, client: httpx.AsyncClient) -> None:
    agent = await staff(backend)
    entities = await tree(client)
    unknown = uuid.uuid4()
    cases = [
        ({"scopes": scopes(("project", unknown))}, "scopes.0.uuid"),
        ({"scopes": scopes(("customer", entities.customer), ("user", unknown))}, "scopes.1.uuid"),
        ({"scopes": [{"type": "group", "uuid": unknown.hex}]}, "scopes.0.type"),
        ({"scopes": [{"type": "customer", "uuid": "nope"}]}, "scopes.0.uuid"),
        ({"scopes": scopes(("customer", entities.customer)) * 2}, "scopes"),
        ({"scopes": scopes(*[("customer", uuid.uuid4()) for _ in range(1000)])}, "scopes"),
        ({"scopes": [], "payload_filters": {"action": "create"}}, "payload_filters.action"),
        ({"scopes": [], "payload_filters": ["action"]}, "payload_filters"),
        ({"scopes": [], "payload_filters": {"action": []}}, "payload_filters.action"),
    ]
    for body, field in cases:
        response = await register(agent, body)
        assert response.status_code == 400, (field, response.text)
        assert response.json()["errors"][0]["field"] == field, response.text
    too_many = await register(
        agent, {"scopes": scopes(*[("customer", uuid.uuid4()) for _ in range(1000)])}
    )
    assert "100" in too_many.json()["detail"]  # the limit is named
    assert (await client.get(CONSUMERS, headers=agent.headers)).json() == []


async def test_global_and_other_users_for_staff_and_support(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    state: Runtime = app.state.queuekeeper
    admin = await staff(backend)
    helper = await staff(backend, is_support=True)
    someone = await backend.put_user()
    made = await register(admin, {"scopes": []})
    assert made.status_code == 201, made.text
    assert (await register(admin, {"scopes": []})).status_code == 200
    assert (await register(helper, {"scopes": scopes(("user", someone.uuid))})).status_code == 201
    (listed,) = (await client.get(CONSUMERS, headers=admin.headers)).json()
    assert (listed["is_global"], listed["scopes"], listed["user_is_staff"]) == (True, [], True)
    assert [
        c["is_global"]
        for c in (await client.get(CONSUMERS, params={"is_global": "true"}, headers=SERVICE)).json()
    ] == [True]
    # A staff user demoted: its global consumer is blocked, said on the row.
    await backend.put_user(admin.uuid, token=admin.token)
    (row,) = (await client.get(CONSUMERS, headers=admin.headers)).json()
    assert row["delivery_blocked_reason"] == "no_access"
    async with state.sessions() as session:
        bindings = await session.scalar(select(func.count()).select_from(EventConsumerBinding))
        consumers = await session.scalar(select(func.count()).select_from(EventConsumer))
    assert (bindings, consumers) == (1, 2)


async def test_a_revoked_role_shows_on_the_row_and_a_deleted_entity_takes_its_bindings(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent = await backend.put_user()
    owner = await customer(client)
    granted = await role(client, agent, "customer", owner)
    made = await register(agent, {"scopes": scopes(("customer", owner))})
    assert made.status_code == 201
    await unrole(client, granted)
    (row,) = (await client.get(CONSUMERS, headers=agent.headers)).json()
    assert row["delivery_blocked_reason"] == "no_access"
    gone = await client.delete(f"/api/internal/customers/{owner}/", headers=SERVICE)
    assert gone.status_code == 204
    (row,) = (await client.get(CONSUMERS, headers=agent.headers)).json()
    assert (row["scopes"], row["is_global"]) == ([], False)  # never global by accident
