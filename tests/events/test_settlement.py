"""The relay writes confirmed copies published together, every `relay_settle_interval`
(docs/decisions/019-settle-interval.md): fewer statements at a backend's pace, and nothing
lost or answered early for it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime

import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.events.relay import Relay
from tests.events.support import (
    event_detail,
    order_event,
    post_event,
    queue_depth,
    register,
    wait_settled,
)
from tests.helpers import Backend, database_statements


def _relay(app: FastAPI) -> Relay:
    relay: Relay | None = app.state.queuekeeper.relay
    assert relay is not None
    return relay


async def _finished(client: httpx.AsyncClient, event_ids: list[str]) -> list[str]:
    stamps = []
    for event_id in event_ids:
        (copy,) = (await wait_settled(client, event_id))["deliveries"]
        assert copy["state"] == "published"
        assert copy["attempts"] == 1
        stamps.append(copy["finished"])
    return stamps


@pytest.mark.parametrize(
    ("interval", "statements"),
    [pytest.param(1.0, 1, id="gathered"), pytest.param(0.0, 3, id="each-at-once")],
)
async def test_single_events_confirmed_within_the_interval_are_written_in_one_statement(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, interval: float, statements: int
) -> None:
    relay = _relay(app)
    relay.settings = relay.settings.model_copy(update={"relay_settle_interval": interval})
    registered = await register(backend)
    event_ids = []
    # The relay's engine (its own pool); on PostgreSQL every statement sent to asyncpg.
    with database_statements(app.state.queuekeeper.relay_engine) as sent:
        for _ in range(3):  # one after another, as a backend sends them
            response = await post_event(client, order_event(registered.offering))
            assert response.status_code == 202
            event_ids.append(response.json()["event_id"])
            # Confirmed before the next is sent: each is a batch of its own.
            while await queue_depth(registered.vhost, registered.queue_name) < len(event_ids):
                await asyncio.sleep(0.01)
        stamps = await _finished(client, event_ids)
    writes = [s for s in sent if s.lstrip().startswith("UPDATE deliveries") and "finished" in s]
    assert len(writes) == statements, writes
    # Each copy's `finished` is when the broker confirmed it, not when it was written.
    assert stamps == sorted(stamps)
    assert len(set(stamps)) == 3


@pytest.mark.settings(relay_settle_interval=30.0)
async def test_a_wait_true_request_has_its_copies_written_at_once(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    started = asyncio.get_running_loop().time()
    response = await post_event(client, order_event(registered.offering), wait=True)
    assert response.status_code == 200
    assert [d["state"] for d in response.json()["deliveries"]] == ["published"]
    assert asyncio.get_running_loop().time() - started < 10  # not the 30 s interval


@pytest.mark.settings(relay_settle_interval=30.0)
async def test_a_stopping_relay_writes_the_copies_it_had_confirmed(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering))
    event_id = response.json()["event_id"]
    while await queue_depth(registered.vhost, registered.queue_name) < 1:
        await asyncio.sleep(0.01)
    # Confirmed by the broker, gathered, not written yet.
    assert [d["state"] for d in (await event_detail(client, event_id))["deliveries"]] == ["pending"]
    await _relay(app).stop()
    (copy,) = (await event_detail(client, event_id))["deliveries"]
    assert (copy["state"], copy["attempts"]) == ("published", 1)


@pytest.mark.settings(relay_settle_interval=0.05, relay_backoff_base=0.1)
async def test_a_failed_write_of_confirmed_copies_is_retried_not_published_again(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    relay = _relay(app)
    real_publish = relay.outbox.published_at
    calls = 0

    async def down_once(confirmed: Sequence[tuple[int, datetime]]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("the database went away")
        await real_publish(confirmed)

    relay.outbox.published_at = down_once  # type: ignore[method-assign]
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering))
    (stamp,) = await _finished(client, [response.json()["event_id"]])
    assert stamp is not None
    assert calls == 2
    assert await queue_depth(registered.vhost, registered.queue_name) == 1  # published once
