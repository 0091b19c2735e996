"""Copies already in a broker queue leave it when access ends, whichever way it ends
(contract §14; docs/decisions/030-queued-copies-on-every-access-loss.md): within 15 s of a
pushed change, 30 s of an expiry that arrives by time. The agent is not reading: its copies
wait ready in the queue while access goes; the queue is watched with passive declares and
read afterwards over STOMP as the agent reads it. Copies the owner still may receive
(through another binding, its own user) stay, in acceptance order."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest

from queuekeeper.config import Settings
from queuekeeper.consumers import repository
from queuekeeper.db import create_engine, create_sessionmaker
from queuekeeper.models import AccessSweep, Role, User, utcnow
from tests.consumers.scopes import SERVICE, Tree, put, role, scopes, staff, tree, unrole
from tests.consumers.sweeps import (
    BY_TIME,
    PUSHED,
    holds,
    push_user,
    read_when_let_in,
    sent,
    swept,
)
from tests.consumers.test_scoped_delivery import consumer_of, identity_event
from tests.events.support import order_event
from tests.helpers import Agent, Backend


async def delete(client: httpx.AsyncClient, path: str) -> None:
    response = await client.delete(f"/api/internal{path}", headers=SERVICE)
    assert response.status_code == 204, response.text


Change = Callable[[], Awaitable[None]]


async def set_up(
    backend: Backend, client: httpx.AsyncClient, how: str, entities: Tree
) -> tuple[Agent, dict[str, Any], Change, dict[str, Any]]:
    """An owner, its consumer, the change that ends its access to `entities`' events, and
    the user fields that let it in again afterwards (nothing for most)."""
    if how in ("staff_demoted", "support_demoted", "staff_demoted_global"):
        flag = "is_support" if how == "support_demoted" else "is_staff"
        owner = await staff(backend, **{flag: True})
        # Staff may bind what they hold no role on, and bind nothing (global).
        bindings = [] if how == "staff_demoted_global" else [("project", entities.project)]
        consumer = await consumer_of(owner, {"scopes": scopes(*bindings)})
        return owner, consumer, lambda: push_user(client, owner), {}
    owner = await backend.put_user()
    if how == "grant_removed":
        await backend.grant(owner, entities.offering)
        kept = await backend.put_offering()
        await backend.grant(owner, kept)
        entities.extra["kept_offering"] = kept
        consumer = await consumer_of(
            owner, {"scopes": scopes(("offering", entities.offering), ("offering", kept))}
        )
        return (
            owner,
            consumer,
            lambda: delete(client, f"/offerings/{entities.offering}/users/{owner.uuid}/"),
            {},
        )
    kind, entity = (
        ("project", entities.project)
        if how == "project_deleted"
        else ("customer", entities.customer)
    )
    granted = await role(client, owner, kind, entity)
    consumer = await consumer_of(owner, {"scopes": scopes((kind, entity), ("user", owner.uuid))})
    other = await tree(client)
    changes: dict[str, Change] = {
        "role_deleted": lambda: unrole(client, granted),
        "role_moved": lambda: role_on(client, granted, owner, "customer", other.customer),
        "role_expired_by_push": lambda: role_on(
            client, granted, owner, kind, entity, expires_at=utcnow() - timedelta(seconds=1)
        ),
        "deactivated": lambda: push_user(client, owner, is_active=False),
        "token_removed": lambda: push_user(client, owner, token=None),
        "offering_deleted": lambda: delete(client, f"/offerings/{entities.offering}/"),
        "customer_deleted": lambda: delete(client, f"/customers/{entities.customer}/"),
        "project_deleted": lambda: delete(client, f"/projects/{entities.project}/"),
    }
    let_in: dict[str, Any] = {
        "deactivated": {"is_active": True},
        "token_removed": {"token": f"token-again-{uuid.uuid4().hex}"},
    }.get(how, {})
    return owner, consumer, changes[how], let_in


async def role_on(
    client: httpx.AsyncClient,
    role_uuid: uuid.UUID,
    owner: Agent,
    kind: str,
    entity: uuid.UUID,
    **extra: Any,
) -> None:
    body = {
        "user_uuid": owner.uuid.hex,
        "role_name": f"{kind}.member",
        "scope": {"type": kind, "uuid": entity.hex},
        **{key: value.isoformat() for key, value in extra.items()},
    }
    await put(client, f"/roles/{role_uuid}/", body)


@pytest.mark.parametrize(
    "how",
    [
        "role_deleted",
        "role_moved",
        "role_expired_by_push",
        "staff_demoted",
        "staff_demoted_global",
        "support_demoted",
        "deactivated",
        "token_removed",
        "grant_removed",
        "offering_deleted",
        "customer_deleted",
        "project_deleted",
    ],
)
async def test_queued_copies_leave_when_access_ends(
    backend: Backend, client: httpx.AsyncClient, settings: Settings, how: str
) -> None:
    entities = await tree(client)
    owner, consumer, change, let_in = await set_up(backend, client, how, entities)
    # Orders of the offering, one of them placed in its project too: what the change takes
    # away. An offering deleted leaves that one: the event's own project still reaches it.
    in_project = "kept" if how == "offering_deleted" else "lost"
    events = [
        ("lost", await sent(client, order_event(entities.offering))),
        (
            in_project,
            await sent(client, order_event(entities.offering, project_uuid=entities.project.hex)),
        ),
        ("lost", await sent(client, order_event(entities.offering))),
    ]
    if how == "grant_removed":  # the other offering stays granted and bound
        events.append(("kept", await sent(client, order_event(entities.extra["kept_offering"]))))
    elif not how.startswith(("staff", "support")) and not let_in:
        # Its own user stays bound (an inactive owner, or one without a token, may receive
        # nothing at all).
        events.append(("kept", await sent(client, identity_event(owner.uuid))))
    kept = [event_id for kind, event_id in events if kind == "kept"]
    await holds(owner, consumer, len(events), 10.0)

    await change()
    took = await holds(owner, consumer, len(kept), PUSHED)
    await swept(settings)
    token = let_in.get("token")
    if let_in:
        await push_user(client, owner, **let_in)
    assert await read_when_let_in(owner, consumer, len(kept), token) == kept
    print(f"{how}: queued copies gone {took:.2f} s after the change")


@pytest.mark.parametrize("what", ["role", "token"])
async def test_queued_copies_leave_when_an_expiry_arrives_by_time(
    backend: Backend, client: httpx.AsyncClient, settings: Settings, what: str
) -> None:
    """Nobody pushes anything: the role's (or the token's) `expires_at` just passes."""
    entities = await tree(client)
    owner = await backend.put_user()
    ends = utcnow() + timedelta(seconds=4)
    await role(
        client, owner, "customer", entities.customer, expires_at=ends if what == "role" else None
    )
    consumer = await consumer_of(
        owner, {"scopes": scopes(("customer", entities.customer), ("user", owner.uuid))}
    )
    if what == "token":
        await backend.expire_token_at(owner, ends)
    lost = [await sent(client, order_event(entities.offering)) for _ in range(3)]
    kept = [await sent(client, identity_event(owner.uuid))] if what == "role" else []
    assert utcnow() < ends, "the set-up outlasted the expiry: nothing was queued before it"
    await holds(owner, consumer, len(lost) + len(kept), 10.0)

    left = (ends - utcnow()).total_seconds()
    took = await holds(owner, consumer, len(kept), left + BY_TIME)
    await swept(settings, through=ends)
    if what == "token":
        token = f"token-renewed-{uuid.uuid4().hex}"
        await push_user(client, owner, token=token, token_expires_at=None)
    else:
        token = None
    assert await read_when_let_in(owner, consumer, len(kept), token) == kept
    print(f"{what} expiry: queued copies gone {took - left:.2f} s after it")


async def test_copies_still_authorized_through_another_binding_stay_in_order(
    backend: Backend, client: httpx.AsyncClient, settings: Settings
) -> None:
    """A demoted staff user keeps a role on the project: its copies stay, in order, and
    those of the project it bound as staff alone go."""
    kept_tree, lost_tree = await tree(client), await tree(client)
    owner = await staff(backend)
    await role(client, owner, "project", kept_tree.project)
    consumer = await consumer_of(
        owner,
        {"scopes": scopes(("project", kept_tree.project), ("project", lost_tree.project))},
    )
    events = [
        ("kept", await sent(client, order_event(kept_tree.offering))),
        ("lost", await sent(client, order_event(lost_tree.offering))),
        ("kept", await sent(client, order_event(kept_tree.offering))),
        ("lost", await sent(client, order_event(lost_tree.offering))),
        ("kept", await sent(client, order_event(kept_tree.offering))),
    ]
    await holds(owner, consumer, len(events), 10.0)
    await push_user(client, owner)  # no longer staff
    wanted = [event_id for kind, event_id in events if kind == "kept"]
    await holds(owner, consumer, len(wanted), PUSHED)
    await swept(settings)
    assert await read_when_let_in(owner, consumer, len(wanted)) == wanted


async def test_a_deactivated_users_legacy_queue_is_emptied_too(
    backend: Backend, client: httpx.AsyncClient, settings: Settings
) -> None:
    """An agent 1.0.5 subscription queue: its copies were left in the queue while the user
    was inactive, and read when it came back."""
    owner, offering = await backend.agent_with_offering()
    subscription = await owner.create_subscription()
    made = await owner.create_queue(subscription["uuid"], offering)
    assert made.status_code == 201, made.text
    login = uuid.UUID(subscription["uuid"]).hex
    queue = {"queue_name": made.json()["queue_name"], "rmq_username": login}
    for _ in range(3):
        await sent(client, order_event(offering))
    await holds(owner, queue, 3, 10.0)

    await push_user(client, owner, is_active=False)
    await holds(owner, queue, 0, PUSHED)
    await swept(settings)
    await push_user(client, owner, is_active=True)
    assert await read_when_let_in(owner, queue, 0) == []


async def test_the_sweeps_look_finds_work_exactly_when_a_run_would(
    settings: Settings, clean_state: None
) -> None:
    """The scheduled sweep first looks (consumers/repository.nothing_to_sweep): nothing to do
    with no access change waiting and no expiry since the watermark; work with either."""
    engine = create_engine(settings)
    sessions = create_sessionmaker(engine)
    now = utcnow()
    since = now - timedelta(hours=1)
    try:
        async with sessions() as session:
            assert await repository.nothing_to_sweep(session, now, since)
            user = User(uuid=uuid.uuid4(), username="sweep-look", token_expires_at=now)
            session.add(user)
            await session.commit()
            # Its token expired within (since, now]: a run would sweep its queues.
            assert not await repository.nothing_to_sweep(session, now, since)
            # A run moved the watermark past it: nothing again.
            await repository.sweeps_done(session, [], now, [])
            await session.commit()
            assert await repository.nothing_to_sweep(session, now, since)
            # A role expiring later, once its time has come.
            later = now + timedelta(minutes=1)
            session.add(
                Role(
                    uuid=uuid.uuid4(),
                    user_uuid=user.uuid,
                    role_name="customer.owner",
                    scope_type="customer",
                    scope_uuid=uuid.uuid4(),
                    expires_at=later,
                )
            )
            await session.commit()
            assert await repository.nothing_to_sweep(session, now, since)
            assert not await repository.nothing_to_sweep(session, later, since)
            # An access change waiting (a trigger's row), whatever the clock says.
            session.add(AccessSweep(owner_uuid=user.uuid, reason="role_deleted"))
            await session.commit()
            assert not await repository.nothing_to_sweep(session, now, since)
    finally:
        await engine.dispose()
