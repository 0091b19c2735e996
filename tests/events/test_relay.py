"""The relay's own rules: leases, backoff, outbox figures, stopping (pruning: the retention
job, tests/parking/test_retention.py)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from queuekeeper.events.outbox import Outbox
from queuekeeper.models import Delivery, utcnow
from queuekeeper.observability.metrics import OUTBOX_OLDEST_AGE, OUTBOX_PENDING
from tests.events.support import (
    SERVICE,
    event_detail,
    order_event,
    post_batch,
    post_event,
    register,
    relay_of,
)
from tests.helpers import Backend
from tests.proxy import TcpProxy, free_port

pytestmark = pytest.mark.settings(relay_enabled=False)


def _parse(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def test_a_claim_is_exclusive_until_its_lease_runs_out(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    await post_batch(client, [order_event(registered.offering) for _ in range(3)])
    state = app.state.queuekeeper
    short = Outbox(state.engine, state.settings.model_copy(update={"relay_lease_seconds": 20}))
    longer = Outbox(state.engine, state.settings.model_copy(update={"relay_lease_seconds": 60}))
    claimed_at = utcnow()
    first, _ = await short.claim("relay-a", claimed_at, 10)
    assert len(first) == 3
    assert {c.attempts for c in first} == {1}
    assert first == sorted(first, key=lambda c: c.id)
    assert (await longer.claim("relay-b", utcnow(), 10))[0] == []
    # The claim's time is the statement's `now`: a claim as of the lease's end, not a
    # sleep that a stall of a loaded machine could stretch past a short lease.
    assert (await longer.claim("relay-b", claimed_at + timedelta(seconds=19.9), 10))[0] == []
    taken, _ = await longer.claim("relay-b", claimed_at + timedelta(seconds=20), 10)
    assert sorted(c.id for c in taken) == sorted(c.id for c in first)
    assert {c.attempts for c in taken} == {2}
    detail = await event_detail(client, first[0].event_id)
    assert detail["deliveries"][0]["claimed_by"] == "relay-b"


async def test_an_unreachable_broker_is_retried_with_capped_exponential_backoff(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering))
    event_id = response.json()["event_id"]
    port = free_port()
    relay, publisher = relay_of(
        app,
        amqp_url=f"amqp://guest:guest@127.0.0.1:{port}/",
        # Seconds, not tenths: "not due yet" must hold through a stall of a loaded machine.
        relay_backoff_base=20.0,
        relay_backoff_max=30.0,
    )
    try:
        before = utcnow()
        assert await relay.run_once() == 1
        copy = (await event_detail(client, event_id))["deliveries"][0]
        assert copy["state"] == "pending"
        assert copy["attempts"] == 1
        assert copy["claimed_by"] is None
        # The broker it could not reach, named whichever loop runs (uvloop says only
        # "Connection refused").
        assert f"127.0.0.1:{port}" in copy["last_error"], copy["last_error"]
        # First retry after base * [0.5, 1] seconds.
        delay = (_parse(copy["next_attempt_at"]) - before).total_seconds()
        assert 10.0 <= delay <= 30.0, delay
        assert await relay.run_once() == 0  # not due yet

        # Many attempts later the delay is capped.
        async with app.state.queuekeeper.sessions() as session:
            await session.execute(
                update(Delivery)
                .where(Delivery.event_id == event_id)
                .values(attempts=9, next_attempt_at=utcnow())
            )
            await session.commit()
        before = utcnow()
        assert await relay.run_once() == 1
        copy = (await event_detail(client, event_id))["deliveries"][0]
        assert copy["attempts"] == 10
        delay = (_parse(copy["next_attempt_at"]) - before).total_seconds()
        assert 15.0 <= delay <= 40.0, delay
    finally:
        await publisher.close()


async def test_outbox_depth_is_readable_and_exported(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    empty = await client.get("/api/admin/outbox/", headers=SERVICE)
    assert empty.json() == {"pending": 0, "claimed": 0, "oldest_pending_age_seconds": 0.0}
    await post_batch(client, [order_event(registered.offering) for _ in range(3)])
    await asyncio.sleep(0.2)
    state = app.state.queuekeeper
    await Outbox(state.engine, state.settings).claim("relay-x", utcnow(), 1)
    stats = (await client.get("/api/admin/outbox/", headers=SERVICE)).json()
    assert (stats["pending"], stats["claimed"]) == (3, 1)
    assert 0.2 <= stats["oldest_pending_age_seconds"] < 10

    relay, publisher = relay_of(app)
    try:
        await relay.refresh_gauges()
        assert OUTBOX_PENDING._value.get() == 3
        assert OUTBOX_OLDEST_AGE._value.get() >= 0.2
        relay.start()  # publishes what is due; the claimed copy waits for its lease
        for _ in range(100):
            stats = (await client.get("/api/admin/outbox/", headers=SERVICE)).json()
            if stats["pending"] == 1:
                break
            await asyncio.sleep(0.05)
        assert stats["pending"] == 1
        await relay.refresh_gauges()
        assert OUTBOX_PENDING._value.get() == 1
    finally:
        await relay.stop()
        await publisher.close()
    assert (await client.get("/api/admin/outbox/")).status_code == 401


async def test_a_stopping_relay_stops_at_once_when_idle(app: FastAPI) -> None:
    relay, publisher = relay_of(app, relay_poll_interval=30.0)
    relay.start()
    await asyncio.sleep(0.1)
    started = time.perf_counter()
    await relay.stop()
    await publisher.close()
    assert time.perf_counter() - started < 0.5


async def test_a_stopping_relay_cuts_a_hanging_batch_short_and_leaves_it_to_the_lease(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    hang = TcpProxy(blackhole=True)  # the broker accepts the connection and never answers
    hang.start()
    relay, publisher = relay_of(app, amqp_url=hang.amqp_url(), amqp_connect_timeout=30.0)
    try:
        relay.start()
        response = await post_event(client, order_event(registered.offering))
        event_id = response.json()["event_id"]
        for _ in range(100):
            if hang.accepted:
                break
            await asyncio.sleep(0.02)
        assert hang.accepted, "the relay never tried to publish"
        started = time.perf_counter()
        await relay.stop(grace=0.3)
        assert time.perf_counter() - started < 2
    finally:
        await publisher.close()
        hang.close()
    copy = (await event_detail(client, event_id))["deliveries"][0]
    assert (copy["state"], copy["claimed_by"]) == ("pending", relay.id)
