"""Contract §14, "judged as it leaves", for queue consumers: a copy is judged against the
directory as it stands when it is published, whatever brought it to the relay (handed over
by the store of the same process, or claimed), with no window of trust after acceptance;
only a proof that nothing the rule reads changed lets a copy skip the rule
(docs/decisions/029-judged-as-it-leaves.md). Real broker, a real STOMP consumer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, text

from queuekeeper.app import Runtime, start_relay
from queuekeeper.events.outbox import Claimed, Outbox
from queuekeeper.events.outbox_postgres import ACCESS, REFUSED_REASON
from queuekeeper.models import Delivery, utcnow
from tests.consumers.scopes import Tree, role, scopes, tree, unrole
from tests.consumers.test_event_consumers_api import register
from tests.events.support import event_detail, order_event, post_event
from tests.helpers import Agent, Backend, database_statements
from tests.stomp_client import StompConsumer

# How long a role given with an expiry stays valid: long enough to accept an event first.
EXPIRES_IN = 1.5


async def _watching(
    client: httpx.AsyncClient, backend: Backend, *, expires_in: float | None = None
) -> tuple[Agent, Tree, Tree, uuid.UUID, dict[str, str]]:
    """A user with a role on one customer (`lost`: deleted or expiring later) and one on
    another's project (`kept`), and a queue consumer bound to both."""
    lost, kept = await tree(client), await tree(client)
    watcher = await backend.put_user()
    expires_at = utcnow() + timedelta(seconds=expires_in) if expires_in is not None else None
    revoked = await role(client, watcher, "customer", lost.customer, expires_at=expires_at)
    await role(client, watcher, "project", kept.project)
    made = await register(
        watcher, {"scopes": scopes(("customer", lost.customer), ("project", kept.project))}
    )
    assert made.status_code in (200, 201), made.text
    return watcher, lost, kept, revoked, made.json()


@asynccontextmanager
async def _reading(watcher: Agent, consumer: dict[str, str]) -> AsyncIterator[StompConsumer]:
    reader = StompConsumer(watcher.vhost, consumer["rmq_username"], watcher.token)
    await asyncio.to_thread(reader.connect)
    try:
        reader.subscribe(f"/amq/queue/{consumer['queue_name']}")
        yield reader
    finally:
        await asyncio.to_thread(reader.close)


async def _accepted(client: httpx.AsyncClient, offering: uuid.UUID) -> str:
    answer = await post_event(client, order_event(offering))
    assert answer.status_code in (200, 202), answer.text
    assert answer.json()["queued"] == 1, answer.text
    event_id: str = answer.json()["event_id"]
    return event_id


async def _refused(app: FastAPI, event_id: str) -> None:
    """The copy of `event_id` was given up as not authorized, never published."""
    async with app.state.queuekeeper.sessions() as session:
        found = (
            await session.execute(
                select(Delivery.state, Delivery.last_error).where(Delivery.event_id == event_id)
            )
        ).all()
    assert [(str(state), error) for state, error in found] == [("given_up", REFUSED_REASON)]


async def _settled(app: FastAPI, event_id: str, timeout: float = 15.0) -> None:
    """Wait until the copy of `event_id` is no longer pending."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        async with app.state.queuekeeper.sessions() as session:
            states = (
                await session.scalars(select(Delivery.state).where(Delivery.event_id == event_id))
            ).all()
        if states and all(str(state) != "pending" for state in states):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the copy of {event_id} is still pending")


async def _epoch(app: FastAPI) -> int:
    async with app.state.queuekeeper.sessions() as session:
        value = await session.scalar(
            text("SELECT coalesce((SELECT value FROM access_epoch WHERE id = 1), 0)")
        )
    return int(value or 0)


@pytest.mark.parametrize("ending", ["deleted", "expired"])
async def test_a_copy_handed_to_the_relay_is_judged_when_it_leaves(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, ending: str
) -> None:
    """The store hands its copies to the relay of its process, already claimed: no claim
    judges them again. Held in the hand-off (a busy relay) while the role that let them
    through is deleted, or expires by time with no push, they are given up when the relay
    takes them to publish; the consumer reads only the other binding's event. Before: the
    store's judgment was trusted, and the agent received the lost customer's event."""
    state: Runtime = app.state.queuekeeper
    relay = state.relay
    assert relay is not None
    assert relay.hold_back is not None
    watcher, lost, kept, revoked, consumer = await _watching(
        client, backend, expires_in=EXPIRES_IN if ending == "expired" else None
    )
    taken, go = asyncio.Event(), asyncio.Event()
    hold_back = relay.hold_back

    async def busy(relay_id: str, claimed: list[Claimed]) -> list[Claimed]:
        taken.set()
        await go.wait()
        return await hold_back(relay_id, claimed)

    relay.hold_back = busy
    try:
        async with _reading(watcher, consumer) as reader:
            lost_id = await _accepted(client, lost.offering)
            await asyncio.wait_for(taken.wait(), 10)
            if ending == "deleted":
                await unrole(client, revoked)
            else:  # no push: the role's time runs out while the copy waits
                await asyncio.sleep(EXPIRES_IN + 0.2)
            go.set()
            kept_id = await _accepted(client, kept.offering)
            await asyncio.to_thread(reader.wait_for_ids, {kept_id}, 15.0)
            await asyncio.sleep(0.5)  # anything else on its way arrives meanwhile
            ids = [message.headers.get("amqp-message-id") for message in reader.listener.messages]
            assert ids == [kept_id]
    finally:
        relay.hold_back = hold_back
    await _refused(app, lost_id)
    detail = await event_detail(client, lost_id)
    assert [d["state"] for d in detail["deliveries"]] == ["given_up"]


@pytest.mark.settings(relay_concurrency=1)
async def test_a_copy_waiting_for_a_busy_relay_is_judged_when_it_leaves(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """The relay's one batch slot is taken by a batch that does not finish (a slow broker);
    a copy handed over meanwhile waits for the slot, and the role that let it through is
    deleted while it waits: it is given up when the relay takes it, though nothing between
    its store and its hand-over waited. The busy batch's copy, of the kept binding, goes
    out."""
    state: Runtime = app.state.queuekeeper
    relay = state.relay
    assert relay is not None
    assert relay.hold_back is not None
    watcher, lost, kept, revoked, consumer = await _watching(client, backend)
    taken, go = asyncio.Event(), asyncio.Event()
    hold_back = relay.hold_back

    async def slow_first(relay_id: str, claimed: list[Claimed]) -> list[Claimed]:
        if not taken.is_set():
            taken.set()
            await go.wait()
        return await hold_back(relay_id, claimed)

    relay.hold_back = slow_first
    try:
        async with _reading(watcher, consumer) as reader:
            kept_id = await _accepted(client, kept.offering)
            await asyncio.wait_for(taken.wait(), 10)
            lost_id = await _accepted(client, lost.offering)
            await unrole(client, revoked)
            go.set()
            await asyncio.to_thread(reader.wait_for_ids, {kept_id}, 15.0)
            await _settled(app, lost_id)
            await asyncio.sleep(0.5)  # anything else on its way arrives meanwhile
            ids = [message.headers.get("amqp-message-id") for message in reader.listener.messages]
            assert ids == [kept_id]
    finally:
        relay.hold_back = hold_back
    await _refused(app, lost_id)


@pytest.mark.settings(relay_poll_interval=60.0)
async def test_an_idle_relay_publishes_a_handed_copy_on_the_stores_judgment(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """Taken at once by an idle relay, with nothing between the store's write and the
    publish, a handed copy goes out on the store's judgment, as a claimed copy goes out on
    the claim's: no statement of the relay reads the access epoch before it (the light
    statement is for copies that waited)."""
    state: Runtime = app.state.queuekeeper
    watcher, _lost, kept, _revoked, consumer = await _watching(client, backend)
    async with _reading(watcher, consumer) as reader:
        with database_statements(state.relay_engine) as sent:
            event_ids = []
            for _ in range(3):  # one after another: each a batch of its own
                event_ids.append(await _accepted(client, kept.offering))
                await asyncio.to_thread(reader.wait_for_ids, set(event_ids), 15.0)
    assert ACCESS not in sent


@pytest.mark.settings(relay_enabled=False)
async def test_a_copy_just_accepted_is_judged_when_a_relay_claims_it(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """A copy written for any relay (none in this process), never attempted, accepted a
    moment ago: the role is deleted, then a relay starts and claims it. Before: a copy
    younger than 10 s with no attempt counted as fresh from the store and was published
    unjudged; now the claim judges it and gives it up. The other binding's copy goes out."""
    state: Runtime = app.state.queuekeeper
    watcher, lost, kept, revoked, consumer = await _watching(client, backend)
    async with _reading(watcher, consumer) as reader:
        lost_id = await _accepted(client, lost.offering)
        kept_id = await _accepted(client, kept.offering)
        await unrole(client, revoked)
        start_relay(state)
        await asyncio.to_thread(reader.wait_for_ids, {kept_id}, 15.0)
        await asyncio.sleep(0.5)  # anything else on its way arrives meanwhile
        ids = [message.headers.get("amqp-message-id") for message in reader.listener.messages]
        assert ids == [kept_id]
    await _refused(app, lost_id)


@pytest.mark.settings(relay_enabled=False)
async def test_a_role_that_expires_by_time_refuses_the_copy_with_the_epoch_unchanged(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """Time ends access without a write, so without an epoch bump: a copy judged while the
    role was valid and claimed after it expired is given up, not let through by the epoch
    proof; the expiry probe catches it. One of a role still held is claimed."""
    state: Runtime = app.state.queuekeeper
    _watcher, lost, kept, _revoked, _consumer = await _watching(
        client, backend, expires_in=EXPIRES_IN
    )
    lost_id = await _accepted(client, lost.offering)
    kept_id = await _accepted(client, kept.offering)
    epoch = await _epoch(app)
    await asyncio.sleep(EXPIRES_IN + 0.2)
    claimed, _lease = await Outbox(state.engine, state.settings).claim("relay-t", utcnow(), 10)
    assert [item.event_id for item in claimed] == [kept_id]
    assert await _epoch(app) == epoch  # nothing was written: the expiry alone refused it
    await _refused(app, lost_id)
