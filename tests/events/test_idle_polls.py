"""An idle relay looks in the database less and less often while it listens, and is still
woken at once by whatever makes a copy due: an insert, another relay giving copies back, a
retry it scheduled itself (docs/decisions/034-idle-polls.md)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.events.outbox import Outbox
from queuekeeper.events.relay import Relay
from queuekeeper.models import utcnow
from tests.events.support import event_detail, order_event, post_event, register, relay_of
from tests.helpers import Backend
from tests.proxy import TcpProxy

pytestmark = pytest.mark.settings(relay_enabled=False)


def _count_claims(relay: Relay) -> list[float]:
    """The loop time of each claim the relay runs."""
    looks: list[float] = []
    claim: Callable[..., Awaitable[Any]] = relay.outbox.claim

    async def counted(*args: Any) -> Any:
        looks.append(asyncio.get_running_loop().time())
        return await claim(*args)

    relay.outbox.claim = counted  # type: ignore[method-assign]
    return looks


async def _listening(relay: Relay) -> None:
    for _ in range(200):
        if relay._listening:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the relay never listened")


async def _state(client: httpx.AsyncClient, event_id: str, wanted: str, within: float) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        copy = (await event_detail(client, event_id))["deliveries"][0]
        if copy["state"] == wanted:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not {wanted} within {within} s: {copy}")
        await asyncio.sleep(0.05)


async def test_an_idle_relay_looks_less_often_and_an_insert_still_wakes_it_at_once(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    relay, publisher = relay_of(app, relay_poll_interval=0.1, relay_idle_poll_max=30.0)
    looks = _count_claims(relay)
    relay.start()
    try:
        await _listening(relay)
        await asyncio.sleep(3.0)
        # Every 0.1 s would be some 30 looks; doubling from 0.1 s: 0.1, 0.2, 0.4, 0.8, 1.6.
        assert 2 <= len(looks) <= 7, [round(b - a, 2) for a, b in itertools.pairwise(looks)]
        # The next look is seconds away; the insert's NOTIFY does not wait for it.
        response = await post_event(client, order_event(registered.offering))
        await _state(client, response.json()["event_id"], "published", within=5.0)
    finally:
        await relay.stop()
        await publisher.close()


async def test_copies_another_relay_gives_back_wake_an_idle_relay(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering))
    event_id = response.json()["event_id"]
    state: Runtime = app.state.queuekeeper
    other = Outbox(state.engine, state.settings)
    (held,), _ = await other.claim("relay-b", utcnow(), 10)
    # Its looks 30 s apart: only an announcement brings the copy before then.
    relay, publisher = relay_of(app, relay_poll_interval=30.0, relay_idle_poll_max=30.0)
    looks = _count_claims(relay)
    relay.start()
    try:
        await _listening(relay)
        await asyncio.sleep(0.3)
        assert len(looks) == 1  # its first look, which found the copy held by relay-b
        await other.release("relay-b", [held.id], utcnow())  # relay-b stops, say
        await _state(client, event_id, "published", within=10.0)
        assert len(looks) == 2
    finally:
        await relay.stop()
        await publisher.close()


async def test_a_retry_an_idle_relay_scheduled_wakes_it_when_due(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    broker = TcpProxy()
    broker.start()
    broker.stop()  # the broker unreachable: the first attempt fails
    relay, publisher = relay_of(
        app,
        amqp_url=broker.amqp_url(),
        relay_poll_interval=30.0,
        relay_idle_poll_max=30.0,
        relay_backoff_base=1.0,
        amqp_connect_timeout=2.0,
    )
    relay.start()
    try:
        await _listening(relay)
        response = await post_event(client, order_event(registered.offering))
        event_id = response.json()["event_id"]
        deadline = asyncio.get_running_loop().time() + 15
        while True:  # the failed attempt settled: due again on the backoff
            copy = (await event_detail(client, event_id))["deliveries"][0]
            if copy["last_error"] and copy["claimed_by"] is None:
                break
            assert asyncio.get_running_loop().time() < deadline, f"never failed: {copy}"
            await asyncio.sleep(0.05)
        assert copy["state"] == "pending"
        broker.start()
        # Due again within a second (the backoff base, halved by jitter at most), long
        # before the next look of an idle relay (30 s).
        await _state(client, event_id, "published", within=12.0)
    finally:
        await relay.stop()
        await publisher.close()
        broker.close()


async def test_the_wait_doubles_to_its_cap_and_a_retry_past_due_is_looked_for_once(
    app: FastAPI,
) -> None:
    relay, publisher = relay_of(app, relay_poll_interval=0.5, relay_idle_poll_max=5.0)
    try:
        assert relay._poll_wait() == 0.5  # not listening: every poll interval
        relay._listening = True
        waits = []
        for _ in range(6):
            waits.append(relay._poll_wait())
            relay._looked(False)
        assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
        relay._looked(True)
        assert relay._poll_wait() == 0.5
        # A retry already due (its look did not happen: every slot busy, say): the next
        # wait is zero, once; the one after is the rule's again, never a run of zeros.
        for _ in range(4):
            relay._looked(False)
        relay._retry_scheduled(utcnow() - timedelta(seconds=1))
        assert relay._poll_wait() <= 0.006  # due now (a few milliseconds late, by design)
        await asyncio.sleep(0.01)
        assert relay._poll_wait() == 0.0
        assert relay._poll_wait() == 5.0
        relay._retry_scheduled(utcnow() + timedelta(seconds=2))
        assert 1.5 < relay._poll_wait() <= 2.1
    finally:
        await publisher.close()
