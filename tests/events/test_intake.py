"""Group commit, copies handed to the relay already claimed, lease renewal, load shedding."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, text

from queuekeeper.app import Runtime
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.db import create_engine
from queuekeeper.events import outbox
from queuekeeper.events.relay import Relay
from queuekeeper.models import Delivery, Event, utcnow
from tests.events.support import SERVICE, order_event, post_event, register, wait_settled
from tests.helpers import Backend


class Transactions:
    """Counts the transactions that stored events: the events' rows themselves say it
    (`xmin`, the id of the transaction that inserted a row), whichever way the statements
    reached the database."""

    def __init__(self, app: FastAPI) -> None:
        self.state: Runtime = app.state.queuekeeper

    async def of(self, event_ids: list[str]) -> dict[str, object]:
        """Each event's transaction."""
        async with self.state.sessions() as session:
            rows = await session.execute(
                select(Event.event_id, text("events.xmin::text::bigint")).where(
                    Event.event_id.in_(event_ids)
                )
            )
            return {event_id: xid for event_id, xid in rows}

    async def count(self, event_ids: list[str]) -> int:
        return len(set((await self.of(event_ids)).values()))


# However loaded the machine: no refusals in these two.
@pytest.mark.settings(relay_enabled=False, events_accept_max_wait=60.0)
async def test_concurrent_single_events_share_transactions_and_each_is_answered_after_commit(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    transactions = Transactions(app)
    responses = await asyncio.gather(
        *(post_event(client, order_event(registered.offering)) for _ in range(30))
    )
    assert [r.status_code for r in responses] == [202] * 30
    ids = {r.json()["event_id"] for r in responses}
    # Requests that arrived while a transaction ran went into the next one together.
    count = await transactions.count(sorted(ids))
    assert 0 < count < 10, count
    async with app.state.queuekeeper.sessions() as session:
        stored = set(await session.scalars(select(Event.event_id)))
        copies = list(await session.scalars(select(Delivery.event_id)))
    assert ids <= stored  # answered 202 means committed
    assert sorted(copies) == sorted(ids)


@pytest.mark.settings(relay_enabled=False, events_accept_max_wait=60.0)
async def test_a_bad_request_in_a_shared_transaction_fails_alone(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered = await register(backend)
    # A first request's store is held until the four below are all waiting, so they are
    # stored together in the next one.
    entered, release = asyncio.Event(), asyncio.Event()
    outbox = app.state.queuekeeper.intake.outbox
    real_store = outbox.store

    async def held_store(*args: Any) -> Any:
        if not entered.is_set():
            entered.set()
            await release.wait()
        return await real_store(*args)

    monkeypatch.setattr(outbox, "store", held_store)
    transactions = Transactions(app)
    plug = asyncio.create_task(post_event(client, order_event(registered.offering)))
    await asyncio.wait_for(entered.wait(), 10)
    repeated = f"twice-{uuid.uuid4().hex}"
    sent = asyncio.gather(
        post_event(client, order_event(registered.offering)),
        post_event(client, order_event(uuid.uuid4())),
        post_event(client, order_event(registered.offering, event_id=repeated)),
        post_event(client, order_event(registered.offering, event_id=repeated)),
    )
    intake: Any = app.state.queuekeeper.intake
    for _ in range(500):
        if len(intake._waiting) == 4:
            break
        await asyncio.sleep(0.01)
    assert len(intake._waiting) == 4
    release.set()
    good, bad, first, second = await sent
    assert (await plug).status_code == 202
    assert good.status_code == 202
    assert bad.status_code == 400
    assert bad.json()["errors"][0]["field"] == "offering_uuid"
    # Two requests with one event_id in the same transaction: one is the event, one its repeat.
    assert sorted([first.status_code, second.status_code]) == [200, 202]
    assert {first.json()["queued"], second.json()["queued"]} == {1}
    # And they did share one: two transactions stored the first request's event, the good
    # request's and the repeated one, the bad request's failure notwithstanding.
    stored = [(await plug).json()["event_id"], good.json()["event_id"], repeated]
    assert await transactions.count(stored) == 2


@pytest.mark.settings(relay_poll_interval=60.0)
async def test_the_relay_of_the_process_publishes_accepted_copies_without_a_claim(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    relay = app.state.queuekeeper.relay
    assert relay is not None
    claims = 0
    real_claim = relay.claim

    async def counting_claim() -> list[outbox.Claimed]:
        nonlocal claims
        claims += 1
        return await real_claim()

    relay.claim = counting_claim  # type: ignore[method-assign]
    response = await post_event(client, order_event(registered.offering))
    assert response.status_code == 202
    detail = await wait_settled(client, response.json()["event_id"], timeout=5)
    assert [d["state"] for d in detail["deliveries"]] == ["published"]
    assert detail["deliveries"][0]["attempts"] == 1
    assert claims == 0  # handed over in memory: no poll (60 s away) and no claim query


async def _relay_with_a_claim(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, **changes: Any
) -> tuple[Relay, list[outbox.Claimed]]:
    """A relay (not started) that claimed one accepted copy and holds it unpublished."""
    registered = await register(backend)
    await post_event(client, order_event(registered.offering))
    state: Runtime = app.state.queuekeeper
    settings = state.settings.model_copy(update=changes)
    relay = Relay(settings, state.engine, AmqpPublisher(settings), state.provisioner)
    return relay, await relay.claim()


async def _claimable(app: FastAPI) -> list[outbox.Claimed]:
    """What another relay can claim right now."""
    state = app.state.queuekeeper
    five = state.settings.model_copy(update={"relay_lease_seconds": 5})
    taken, _ = await outbox.Outbox(state.engine, five).claim("other", utcnow(), 10)
    return taken


@pytest.mark.settings(relay_enabled=False)
async def test_a_busy_relay_renews_its_leases_so_no_other_relay_takes_its_copies(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    # Held, not published: as if the process were busy.
    relay, claimed = await _relay_with_a_claim(app, client, backend, relay_lease_seconds=1.5)
    assert len(claimed) == 1
    await asyncio.sleep(0.8)
    assert await relay.renew_leases() == 1
    await asyncio.sleep(0.9)  # the first lease has run out; the renewed one has not
    assert await _claimable(app) == []


async def _burst(
    client: httpx.AsyncClient, backend: Backend, count: int
) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """`count` single events at once: (refused, accepted), each non-empty; the refused
    answered 503 with Retry-After."""
    registered = await register(backend)
    responses = await asyncio.gather(
        *(post_event(client, order_event(registered.offering)) for _ in range(count))
    )
    refused = [r for r in responses if r.status_code == 503]
    accepted = [r for r in responses if r.status_code == 202]
    assert refused
    assert accepted
    assert len(refused) + len(accepted) == count
    assert all(r.headers.get("Retry-After") for r in refused)
    return refused, accepted


@pytest.mark.settings(relay_enabled=False, events_accept_queue=1)
async def test_past_the_intake_queue_requests_are_refused_at_once_and_nothing_is_stored(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    refused, accepted = await _burst(client, backend, 20)
    assert "waiting to be stored" in refused[0].json()["detail"]
    async with app.state.queuekeeper.sessions() as session:
        stored = len(list(await session.scalars(select(Event.event_id))))
    assert stored == len(accepted)


async def test_wait_true_answers_a_copy_handed_to_the_relay_as_published(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering), wait=True)
    assert response.status_code == 200
    assert [d["state"] for d in response.json()["deliveries"]] == ["published"]
    stats = (await client.get("/api/admin/outbox/", headers=SERVICE)).json()
    assert stats["pending"] == 0


@pytest.mark.settings(relay_enabled=False, events_accept_max_wait=0.001)
async def test_when_stored_events_lag_behind_new_requests_are_refused_at_once(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    # Requests behind a transaction of more than a millisecond are refused.
    refused, _accepted = await _burst(client, backend, 40)
    assert "overloaded" in refused[0].json()["detail"]


@pytest.mark.settings(relay_enabled=False)
async def test_a_stopping_relay_gives_back_copies_handed_to_it_but_not_published(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    relay, claimed = await _relay_with_a_claim(app, client, backend)
    relay.hand_over(claimed)  # claimed for it, as the intake writes them
    await relay.stop()
    # Due at once for the next relay, not after the 30 s lease; not counted as an attempt.
    assert [item.attempts for item in await _claimable(app)] == [1]


async def _listening(app: FastAPI) -> bool:
    async with app.state.queuekeeper.engine.connect() as connection:
        found = await connection.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'LISTEN%'"
            )
        )
        return bool(found.scalar_one())


@pytest.mark.settings(relay_enabled=False, relay_poll_interval=60.0)
async def test_a_relay_of_another_process_publishes_at_the_commit_not_at_its_next_poll(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    state: Runtime = app.state.queuekeeper
    # Another process's relay: its own pool, no in-memory signal from this intake.
    engine = create_engine(state.settings)
    relay = Relay(state.settings, engine, AmqpPublisher(state.settings), state.provisioner)
    relay.start()
    try:
        for _ in range(100):
            if await _listening(app):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # its first look found nothing: it now waits out its poll
        response = await post_event(client, order_event(registered.offering))
        assert response.status_code == 202
        detail = await wait_settled(client, response.json()["event_id"], timeout=5)
        assert [d["state"] for d in detail["deliveries"]] == ["published"]
    finally:
        await relay.stop()
        await relay.publisher.close()
        await engine.dispose()


@pytest.mark.settings(relay_enabled=False, events_max_in_flight=1)
async def test_past_the_accept_requests_in_flight_a_request_is_refused_before_its_body(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """One accept request is being handled (its body still arriving): the next is a 503 with
    Retry-After naming the setting, at once, and nothing of it is stored; once the first is
    answered, requests are admitted again."""
    registered = await register(backend)
    body = json.dumps(order_event(registered.offering)).encode()
    release = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield body[:10]
        await release.wait()
        yield body[10:]

    first = asyncio.create_task(
        client.post(
            "/api/internal/events/",
            content=slow_body(),
            headers={
                **SERVICE,
                "Content-Length": str(len(body)),
                "Content-Type": "application/json",
            },
        )
    )
    await asyncio.sleep(0.2)  # admitted, reading its body
    refused = await post_event(client, order_event(registered.offering))
    assert refused.status_code == 503
    assert refused.headers["Retry-After"]
    assert "events_max_in_flight" in refused.json()["detail"]
    release.set()
    assert (await first).status_code == 202
    assert (await post_event(client, order_event(registered.offering))).status_code == 202
    async with app.state.queuekeeper.sessions() as session:
        stored = len(list(await session.scalars(select(Event.event_id))))
    assert stored == 2
